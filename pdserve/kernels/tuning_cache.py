"""Tuned kernel choices that persist across server starts: the skinny-GEMM and FP8 rows tuners
(`pdserve.kernels.skinny.SkinnyTuner`) look each (tuner, shape, rows, dtype, kind of rows) up here before timing it
and store what they measured after, so a restart on the same machine skips the timing.

The directory: `--kernel-tuning-cache-dir DIR`, else env PDSERVE_TUNING_CACHE_DIR, else
$XDG_CACHE_HOME/pdserve/tuning (~/.cache/pdserve/tuning); `none` or an empty value turns the cache off. It holds one
JSON file (never pickle) per device key: the GPU name, its compute capability, the driver version, the CUDA and torch
versions, the Triton version and TUNER_VERSION; another GPU, driver or Triton is another file, so it never sees
these choices. Each entry's key names the tuner, the shape, the rows, the weight dtype, the kind of rows, the
epilogue and a digest of the candidate configs, so a changed candidate list misses too. What comes from disk is
checked: a file that does not parse, has another schema or another device key is ignored with one warning and
rewritten; an entry whose config is not one of the tuner's candidates is ignored. Writes go to a temporary file
renamed over the old one (os.replace), after merging with what is on disk then: concurrent servers (TP ranks, two
servers on one host) lose nothing worse than the last writer's view. At most MAX_ENTRIES entries per file (the
oldest go first) and MAX_FILE_BYTES read.

`configure` also points Triton's own compiled-kernel cache (TRITON_CACHE_DIR) at DIR/triton when the user set none,
so the compiled kernels persist beside the choices.

Where the cache has no entry, the tuner reads the shipped table of this GPU: pdserve/kernels/tuned/<GPU name>.json
(`table_name`; env PDSERVE_TUNED_TABLES names another folder, `none` turns them off), made from a filled cache by
`python -m pdserve.tools.export_tuned_table`. A table matches on the GPU name, its compute capability and
TUNER_VERSION only, not on the driver, CUDA, torch or Triton (it lists those it was measured with, for the reader):
its entries carry the same keys as the cache's, so a shipped choice is used only for the same tuner, shape, rows,
dtypes, epilogue and candidate list, and only if it is one of the tuner's current candidates for that row count and
runs here (the tuner checks both); a Triton or driver of other speeds may then make it a slower choice, never a
wrong one. A table is never written at run time; one that is corrupt or names another GPU is ignored with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

logger = logging.getLogger(__name__)

ENV = "PDSERVE_TUNING_CACHE_DIR"
TABLES_ENV = "PDSERVE_TUNED_TABLES"
SCHEMA = "pdserve-tuning-cache/1"
TABLE_SCHEMA = "pdserve-tuned-table/1"
PACKAGE_TABLES = Path(__file__).with_name("tuned")
TABLE_KEY = ("gpu", "capability", "tuner")  # the fields of a device key a shipped table must match
TUNER_VERSION = 1  # bump when what a tuner measures changes in a way the candidate digest does not show
MAX_ENTRIES = 20_000
MAX_FILE_BYTES = 8 << 20
OFF = ("", "none")

_directory: Path | None = None  # set by `configure`; None: the cache is off (the default outside a server)
_caches: dict[tuple[Path, str], TuningCache] = {}
_tables: dict[tuple[Path, str], Mapping[str, object]] = {}


class Unusable(ValueError):
    """A cache or table file that cannot be used (what is wrong with it is the message)."""


def resolve_dir(setting: str | None, environ: dict | None = None) -> Path | None:
    """The cache directory for a flag value (None: not given): the flag, else env PDSERVE_TUNING_CACHE_DIR, else
    $XDG_CACHE_HOME/pdserve/tuning (~/.cache when unset); None where the value is `none` or empty."""
    environ = os.environ if environ is None else environ
    if setting is None:
        setting = environ.get(ENV)
    if setting is None:
        base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "pdserve" / "tuning"
    if setting.strip().lower() in OFF:
        return None
    return Path(setting).expanduser()


def configure(setting: str | None) -> Path | None:
    """Turns the cache on in this process at the directory `resolve_dir` gives (or off), and sets TRITON_CACHE_DIR
    to its triton/ folder where the environment has none. Returns the directory."""
    global _directory
    _directory = resolve_dir(setting)
    _caches.clear()
    if _directory is not None and not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = str(_directory / "triton")
    logger.info("kernel tuning cache: %s", _directory if _directory is not None else "off")
    return _directory


def directory() -> Path | None:
    return _directory


def driver_version() -> str:
    """The NVIDIA driver's version (e.g. 550.54.15), or the CUDA driver API's, or "unknown"."""
    try:
        import pynvml  # nvidia-ml-py, where installed

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        if m := re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text):
            return m.group(1)
    except OSError:
        pass
    try:
        import torch

        return f"cuda-driver-api-{torch._C._cuda_getDriverVersion()}"
    except Exception:
        return "unknown"


def device_key(device) -> dict[str, str]:
    """What a tuned choice is valid for: this GPU's name and capability, the driver, CUDA, torch and Triton."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(device)
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        driver = driver_version()
    else:
        name, capability, driver = str(torch.device(device).type), "none", "none"
    return {"gpu": name, "capability": capability, "driver": driver, "cuda": str(torch.version.cuda),
            "torch": torch.__version__, "triton": triton_version, "tuner": str(TUNER_VERSION)}


def for_device(device) -> TuningCache | None:
    """The cache of this device's key in the configured directory; None while the cache is off."""
    if _directory is None:
        return None
    key = device_key(device)
    ident = _key_digest(key)
    if (_directory, ident) not in _caches:
        _caches[(_directory, ident)] = TuningCache(_directory, key)
    return _caches[(_directory, ident)]


def tables_dir(environ: dict | None = None) -> Path | None:
    """The folder of the shipped tables: env PDSERVE_TUNED_TABLES, else the package's tuned/; None where `none`."""
    setting = (os.environ if environ is None else environ).get(TABLES_ENV)
    if setting is None:
        return PACKAGE_TABLES
    return None if setting.strip().lower() in OFF else Path(setting).expanduser()


def table_name(gpu: str) -> str:
    """The file name of a GPU's shipped table: its name in lower case, each run of other characters one dash
    ("NVIDIA H100 80GB HBM3" -> nvidia-h100-80gb-hbm3.json)."""
    return (re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "device") + ".json"


def shipped_entries(device) -> Mapping[str, object]:
    """The entries of the shipped table of this device's GPU (read-only, read once per process); empty where there
    is none, the tables are off, or the file is unusable (then with one warning)."""
    directory = tables_dir()
    if directory is None:
        return MappingProxyType({})
    expected = {field: device_key(device)[field] for field in TABLE_KEY}
    path = directory / table_name(expected["gpu"])
    ident = (path, _key_digest(expected))
    if ident not in _tables:
        try:
            entries = read_file(path, TABLE_SCHEMA, expected)["entries"]
        except Unusable as e:
            logger.warning("kernel tuning: ignoring the shipped table %s (%s)", path, e)
            entries = {}
        _tables[ident] = MappingProxyType(entries)
        if entries:
            logger.info("kernel tuning: %d entries shipped for %s in %s", len(entries), expected["gpu"], path)
    return _tables[ident]


def read_file(path: Path, schema: str, expected: dict) -> dict:
    """The JSON object of a cache file or table, with its string-keyed entries only; {"entries": {}} where there is
    no file. Unusable where it is too large, not JSON, of another schema, has a field other than `expected` gives,
    or no entries."""
    try:
        size = path.stat().st_size
    except OSError:
        return {"entries": {}}
    if size > MAX_FILE_BYTES:
        raise Unusable(f"{size} bytes, over {MAX_FILE_BYTES}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise Unusable(f"not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != schema:
        raise Unusable("another schema")
    for field, value in expected.items():
        if data.get(field) != value:
            raise Unusable(f"another {field}: {data.get(field)!r}")
    if not isinstance(data.get("entries"), dict):
        raise Unusable("no entries")
    return {**data, "entries": {k: v for k, v in data["entries"].items() if isinstance(k, str)}}


def _key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def digest(value: object) -> str:
    """A short stable digest of a value's repr (a candidate list: a changed list is another entry key)."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:12]


class TuningCache:
    """The entries of one device key: a JSON object {entry key: JSON value}, loaded on first use."""

    def __init__(self, directory: Path, key: dict[str, str]):
        self.directory = Path(directory)
        self.key = dict(key)
        slug = re.sub(r"[^A-Za-z0-9]+", "-", key.get("gpu", "device")).strip("-")[:48] or "device"
        self.path = self.directory / f"{slug}-{_key_digest(self.key)}.json"
        self._entries: dict[str, object] | None = None
        self._new: dict[str, object] = {}

    def get(self, entry: str) -> object | None:
        """The stored value of entry (a JSON value, to be checked by the caller), or None."""
        return self._load().get(entry)

    def put(self, entry: str, value: object) -> None:
        json.dumps(value)  # only JSON values
        self._load()[entry] = value
        self._new[entry] = value

    def save(self) -> None:
        """Writes the entries put since the last save, merged into the file as it is now; atomic (os.replace).
        A failure to write is a warning, never an error: the server runs on with what it measured."""
        if not self._new:
            return
        merged = self._read(warn=False)
        merged.update(self._new)
        if len(merged) > MAX_ENTRIES:
            merged = dict(list(merged.items())[-MAX_ENTRIES:])
        payload = {"schema": SCHEMA, "key": self.key, "entries": merged}
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.directory)
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, sort_keys=True, separators=(",", ":"))
            os.replace(tmp, self.path)
            tmp = None
        except OSError as e:
            logger.warning("kernel tuning cache: cannot write %s: %s", self.path, e)
            return
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self._entries = merged
        self._new = {}

    def _load(self) -> dict[str, object]:
        if self._entries is None:
            self._entries = self._read(warn=True)
        return self._entries

    def _read(self, warn: bool) -> dict[str, object]:
        """The file's entries; {} (with a warning if warn) where it is missing, too large, corrupt, of another
        schema or of another device key. Such a file is replaced at the next save."""
        try:
            return read_file(self.path, SCHEMA, {"key": self.key})["entries"]
        except Unusable as e:
            if warn:
                logger.warning("kernel tuning cache: ignoring %s (%s); it is rewritten after tuning", self.path, e)
            return {}
