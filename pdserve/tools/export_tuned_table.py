"""Exports filled kernel tuning caches into the tables shipped with the package (issue 38), one file per GPU:

    python -m pdserve.tools.export_tuned_table CACHE_DIR... [--out pdserve/kernels/tuned] [--replace]

Reads every cache file (`pdserve.kernels.tuning_cache`, one per device key) in the folders given, groups their
entries by GPU name and compute capability, and writes OUT/<GPU name>.json (`tuning_cache.table_name`) in the shipped
table format: those fields, the tuner version, the driver, CUDA, torch and Triton versions it was measured with (for
the reader; a table matches on the GPU name, capability and tuner version only) and the entries, one a line. Where
two caches of one GPU hold an entry, the newer file's wins. An existing table of that GPU at OUT is merged into
(its entries kept where the caches lack them) unless --replace. Cache files of another tuner version, unusable ones
and files that are no cache are skipped with a message. One GPU run with a fresh cache directory (a server start, or
scripts/fp8_start.sh) gives the table to commit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdserve.kernels import tuning_cache

MEASURED = ("driver", "cuda", "torch", "triton")  # the device key's fields a table lists but does not match


def read_caches(directories: list[Path]) -> dict[tuple[str, str], tuple[list[dict], dict[str, object]]]:
    """(GPU name, capability) -> (the device keys, the entries) of the usable current-tuner caches in directories,
    newer files' entries over older ones'."""
    files = sorted((f for d in directories for f in Path(d).glob("*.json")), key=lambda f: f.stat().st_mtime)
    tables: dict[tuple[str, str], tuple[list[dict], dict[str, object]]] = {}
    for path in files:
        try:
            data = tuning_cache.read_file(path, tuning_cache.SCHEMA, {})
        except tuning_cache.Unusable as e:
            print(f"skipped {path}: {e}", file=sys.stderr)
            continue
        key = data.get("key")
        if not isinstance(key, dict) or not isinstance(key.get("gpu"), str) \
                or key.get("tuner") != str(tuning_cache.TUNER_VERSION):
            print(f"skipped {path}: not a device key of tuner version {tuning_cache.TUNER_VERSION} ({key!r})",
                  file=sys.stderr)
            continue
        keys, entries = tables.setdefault((key.get("gpu"), key.get("capability")), ([], {}))
        keys.append(key)
        entries.update(data["entries"])
    return tables


def table(gpu: str, capability: str, keys: list[dict], entries: dict[str, object], old: dict) -> dict:
    """The shipped table of one GPU: entries over those of old (a table read before, {} for none)."""
    measured = [{field: str(key.get(field)) for field in MEASURED} for key in keys] + old.get("measured_with", [])
    unique = {json.dumps(m, sort_keys=True): m for m in measured if isinstance(m, dict)}
    return {"schema": tuning_cache.TABLE_SCHEMA, "gpu": gpu, "capability": capability,
            "tuner": str(tuning_cache.TUNER_VERSION), "measured_with": [unique[m] for m in sorted(unique)],
            "entries": {**old.get("entries", {}), **entries}}


def dumps(payload: dict) -> str:
    """The table as JSON with one entry a line, sorted: a re-measured table's diff shows what changed."""
    def line(indent: str, key: str, value: object) -> str:
        return f"{indent}{json.dumps(key)}: {json.dumps(value, sort_keys=True)}"

    head = "".join(line(" ", k, v) + ",\n" for k, v in sorted(payload.items()) if k != "entries")
    body = ",\n".join(line("  ", k, v) for k, v in sorted(payload["entries"].items()))
    return "{\n" + head + ' "entries": {\n' + body + "\n }\n}\n"


def export(directories: list[Path], out: Path, replace: bool = False) -> dict[Path, int]:
    """Writes the tables of the caches in directories under out; returns each file written with its entry count."""
    written = {}
    for (gpu, capability), (keys, entries) in read_caches(directories).items():
        path = out / tuning_cache.table_name(gpu)
        old = {}
        if not replace:
            try:
                old = tuning_cache.read_file(path, tuning_cache.TABLE_SCHEMA,
                                             {"gpu": gpu, "capability": capability,
                                              "tuner": str(tuning_cache.TUNER_VERSION)})
            except tuning_cache.Unusable as e:
                print(f"replacing {path}: {e}", file=sys.stderr)
        payload = table(gpu, capability, keys, entries, old)
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(payload))
        written[path] = len(payload["entries"])
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_dirs", nargs="+", type=Path,
                        help="kernel tuning cache folders (--kernel-tuning-cache-dir)")
    parser.add_argument("--out", type=Path, default=tuning_cache.PACKAGE_TABLES,
                        help="folder of the tables (default: the package's, pdserve/kernels/tuned)")
    parser.add_argument("--replace", action="store_true", help="drop the entries of an existing table of the GPU")
    args = parser.parse_args(argv)
    written = export(args.cache_dirs, args.out, args.replace)
    for path, count in written.items():
        print(f"{path}: {count} entries")
    if not written:
        print("no usable tuning cache files in " + ", ".join(map(str, args.cache_dirs)), file=sys.stderr)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
