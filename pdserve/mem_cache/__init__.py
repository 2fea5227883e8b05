"""KV memory: the device pool and allocator, the radix prefix cache and its host and storage tiers."""
