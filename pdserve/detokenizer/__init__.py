"""The detokenizer process: the scheduler's token ids in, text increments out (`process.py`)."""
