"""Tools for developing the router, not shipped with it: stub pdserve servers (`stub`) and the overhead benchmark
(`bench`). Importable with `router/` on the path (pytest adds it; `cd router && python -m tools.bench`)."""
