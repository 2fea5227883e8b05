"""Draw docs/img/*.png from the GPU results kept in benchmarks/results/<date>/ (JSON and logs the benchmarks wrote).

python scripts/plot_benchmarks.py [--results benchmarks/results/2026-11-21]
    [--fp8-results benchmarks/results/2026-11-27b/call3] [--pdl-results benchmarks/results/2026-11-27d]
    [--targets-results benchmarks/results/2026-11-27e] [--pdl-again-results benchmarks/results/2026-11-27f]
    [--batch1-results benchmarks/results/2026-11-27g] [--decode-halves-results benchmarks/results/2026-11-29]
    [--ptx-words-results benchmarks/results/2026-11-29b] [--out docs/img]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OFFLINE_LINE = re.compile(r"Throughput: ([\d.]+) tok/s")
ROOFLINE_LINE = re.compile(r"-> ([\d.]+)%")
TBT_LINE = re.compile(r"TBT\s+([\d.]+) ms")
KV_LINE = re.compile(r"^kv (\d+) tok p\d+ \w+\s+[\d.]+\s+\d+\s+[\d.]+\s+([\d.]+)")


def finish(fig, ax, ylabel: str, title: str, path: Path, legend_at: str = "best") -> None:
    """Label, legend and save one plot."""
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc=legend_at)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def offline_runs(results: Path) -> list[tuple[str, float, float]]:
    runs = []
    first = json.loads((results / "offline-run1-triton-sync.json").read_text())
    runs.append(("triton, sync", first["output_tok_per_s"], 100 * first["roofline_fraction"]))
    for name, label in (("offline-run3-sdpa-sync.log", "sdpa, sync"),
                        ("offline-run3-sdpa-overlap.log", "sdpa, overlapped sampling")):
        text = (results / name).read_text()
        runs.append((label, float(OFFLINE_LINE.search(text)[1]), float(ROOFLINE_LINE.search(text)[1])))
    return runs


def plot_offline(results: Path, out: Path) -> None:
    runs = offline_runs(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar([r[0] for r in runs], [r[1] for r in runs], color=["#4c72b0", "#55a868", "#c44e52"])
    for bar, (_, _, roof) in zip(bars, runs):
        ax.annotate(f"{roof:.0f}% of roofline", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")
    ax.axhline(20000, ls="--", color="gray", label="target 20,000 tok/s")
    finish(fig, ax, "output tok/s", "Offline seeds workload, qwen3-0.6b, H200, 2026-11-21", out / "offline.png")


def plot_decode(results: Path, out: Path) -> None:
    cases = []
    for name, label in (("one_batch-qwen3-0.6b-overlap.json", "qwen3-0.6b"),
                        ("one_batch-llama-3.1-8b-overlap.json", "llama-3.1-8b")):
        for row in json.loads((results / name).read_text())["rows"]:
            cases.append((f"{label}\nbs={row['batch_size']} in={row['input_len']}", 1e3 * row["tbt_s"],
                          1e3 * row["decode_ideal_s"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(cases))
    ax.bar([x - 0.2 for x in xs], [c[1] for c in cases], width=0.4, label="measured time between tokens")
    ax.bar([x + 0.2 for x in xs], [c[2] for c in cases], width=0.4, label="bytes / HBM bandwidth")
    ax.set_xticks(list(xs), [c[0] for c in cases])
    finish(fig, ax, "ms", "Decode step vs HBM roofline (overlap on), H200, 2026-11-21", out / "decode_tbt.png")


def plot_kv_transfer(results: Path, out: Path) -> None:
    series: dict[str, list[tuple[int, float]]] = {}
    backend = None
    for line in (results / "kv_transfer.log").read_text().splitlines():
        if line.startswith("[") and "transport=" in line:
            backend = line[1 : line.index("]")] + " (" + line.split("transport=")[1].strip() + ")"
        elif backend and (m := KV_LINE.match(line)):
            series.setdefault(backend, []).append((int(m[1]), float(m[2])))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.axhline(394, ls="--", color="gray", label="GPU0->GPU1 copy ceiling 394 GB/s")
    ax.axhline(0.7 * 394, ls=":", color="gray", label="target 70%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens (llama-3.1-8b KV, 128 KiB/token)")
    finish(fig, ax, "GB/s", "KV handoff bandwidth, 2x H200 NVLink, 2026-11-21", out / "kv_transfer.png")


def pd_blocks(log: str) -> dict[str, dict]:
    """The per-backend JSON blocks pd_check.py prints ("mooncake {...}")."""
    blocks, name, lines = {}, None, []
    for line in log.splitlines():
        if name is None and line.endswith(" {"):
            name, lines = line[:-2], ["{"]
        elif name is not None:
            lines.append(line)
            if line == "}":
                blocks[name] = json.loads("\n".join(lines))
                name = None
    return blocks


def plot_pd_ttft(results: Path, out: Path) -> None:
    blocks = pd_blocks((results / "pd-llama-3.1-8b-run2.log").read_text())
    lengths = sorted({int(n) for b in blocks.values() for n in b["added_ttft_ms"]})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(blocks)
    for i, (backend, data) in enumerate(blocks.items()):
        xs = [j + i * width for j in range(len(lengths))]
        ax.bar(xs, [data["added_ttft_ms"][str(n)] for n in lengths], width=width, label=backend)
    ax.set_xticks([j + width * (len(blocks) - 1) / 2 for j in range(len(lengths))], [f"{n} tokens" for n in lengths])
    ax.axhline(5, ls="--", color="gray", label="target 5 ms (4k prompt)")
    finish(fig, ax, "added TTFT over colocated (ms)", "PD vs colocated TTFT, llama-3.1-8b, concurrency 1, 2x H200, 2026-11-21", out / "pd_ttft.png")


def plot_fp8_decode(results: Path, out: Path) -> None:
    """bf16 against FP8 time between tokens, one_batch JSON of one call (ob_bf16, ob_fp8, ob4k_bf16, ob4k_fp8)."""
    cases = []
    for suffix, label in (("", "FP8 weights"), ("4k", "FP8 weights + KV")):
        bf16, fp8 = (json.loads((results / f"ob{suffix}_{q}" / "one_batch.json").read_text())["rows"]
                     for q in ("bf16", "fp8"))
        for base, cand in zip(bf16, fp8):
            cases.append((f"bs={base['batch_size']} in={base['input_len']}\n{label}", 1e3 * base["tbt_s"],
                          1e3 * cand["tbt_s"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(cases))
    ax.bar([x - 0.2 for x in xs], [c[1] for c in cases], width=0.4, label="bf16")
    bars = ax.bar([x + 0.2 for x in xs], [c[2] for c in cases], width=0.4, label="FP8")
    for bar, (_, base, cand) in zip(bars, cases):
        ax.annotate(f"{cand / base:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom")
    ax.set_xticks(list(xs), [c[0] for c in cases])
    finish(fig, ax, "time between tokens (ms)", "llama-3.1-8b decode, bf16 vs FP8, H200, 2026-11-27",
           out / "fp8_decode.png")


def plot_fp8_pdl(results: Path, out: Path) -> None:
    """Batch-1 time between tokens with programmatic dependent launch off and on (one_batch logs of two calls; the
    runs of one mode in a call averaged), FP8 against the bf16 figure without it in the same call."""
    modes = (("call3_pdl_bs1", "pdl0", "off"), ("call3_pdl_bs1", "pdl1", "after its wait"),
             ("call5_targets", "pdl0", "off"), ("call5_targets", "pdl1", "short kernels first"))
    groups = []
    for call, mode, label in modes:
        tbt = {q: [float(TBT_LINE.search(f.read_text())[1]) for f in sorted((results / call).glob(f"bs1_{q}_{mode}*.log"))]
               for q in ("bf16", "fp8")}
        groups.append((f"{call[:5]}: PDL {label}", *(sum(v) / len(v) for v in (tbt["bf16"], tbt["fp8"]))))
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(groups))
    ax.bar([x - 0.2 for x in xs], [g[1] for g in groups], width=0.4, label="bf16")
    bars = ax.bar([x + 0.2 for x in xs], [g[2] for g in groups], width=0.4, label="FP8 weights")
    for bar, (_, _, fp8), (call, _, _) in zip(bars, groups, modes):
        bf16_off = next(g[1] for g, m in zip(groups, modes) if m[0] == call and m[1] == "pdl0")
        ax.annotate(f"{fp8 / bf16_off:.3f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom")
    ax.axhline(0.6 * groups[2][1], ls="--", color="gray", label="0.6x bf16 (call 5)")
    ax.set_xticks(list(xs), [g[0] for g in groups])
    finish(fig, ax, "time between tokens (ms)", "llama-3.1-8b batch 1, 1k context, H100, 2026-11-27 (FP8 / bf16 off)",
           out / "fp8_pdl.png", legend_at="lower right")


def one_batch_tbt_ms(path: Path) -> float:
    return 1e3 * json.loads(path.read_text())["rows"][0]["tbt_s"]


def plot_fp8_steps(results: Path, out: Path) -> None:
    """The two decode targets as FP8 / bf16 ratios after each of the fifth session's changes (bf16 and FP8 from the
    same call each time; the fourth session's last figures from docs/benchmarks.md)."""
    steps = [("4th session", 3.868 / 6.108, 11.534 / 18.078)]
    for call, label in (("call1_stages", "copies\npipelined"), ("call5_4k", "split merge,\nblock shapes"),
                        ("call9_targets", "V as words")):
        folder = results / call
        bs1 = (one_batch_tbt_ms(results / "call3_batch1/one_batch_bs1_fp8.json")
               / one_batch_tbt_ms(results / "call3_batch1/one_batch_bs1_none.json")) if call == "call5_4k" else None
        steps.append((label, bs1, one_batch_tbt_ms(folder / "one_batch_4k_fp8.json")
                      / one_batch_tbt_ms(folder / "one_batch_4k_none.json")))
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(steps))
    for offset, column, label in ((-0.2, 1, "batch 1, 1k, FP8 weights"), (0.2, 2, "batch 64 at 4k, FP8 weights + KV")):
        points = [(x + offset, step[column]) for x, step in zip(xs, steps) if step[column] is not None]
        bars = ax.bar([p[0] for p in points], [p[1] for p in points], width=0.4, label=label)
        for bar, (_, ratio) in zip(bars, points):
            ax.annotate(f"{ratio:.3f}", (bar.get_x() + bar.get_width() / 2, ratio), ha="center", va="bottom")
    ax.axhline(0.6, ls="--", color="gray", label="target 0.6")
    ax.set_ylim(0.5, 0.71)
    ax.set_xticks(list(xs), [step[0] for step in steps])
    finish(fig, ax, "FP8 / bf16 time between tokens", "llama-3.1-8b decode on an H100, 2026-11-27 (fifth session)",
           out / "fp8_targets.png", legend_at="upper center")


def plot_pdl_again(results: Path, out: Path) -> None:
    """The sixth session's PDL form (streaming kernels release the next after their main loop) against PDL off:
    FP8 / bf16 time between tokens, both from one call (C); PDL was reverted after two hangs in graph capture."""
    folder = results / "callC_targets"

    def ratio(fp8: str, bf16: str) -> float:
        return one_batch_tbt_ms(folder / f"one_batch_{fp8}.json") / one_batch_tbt_ms(folder / f"one_batch_{bf16}.json")

    cases = [("batch 1, 1k\nPDL off", ratio("bs1_pdl0_fp8", "bs1_pdl0_none")),
             ("batch 1, 1k\nPDL on, no prefetch", ratio("bs1_pdl1_no_prefetch_fp8", "bs1_pdl1_none")),
             ("batch 64 at 4k\nPDL on, FP8 KV too", ratio("4k_pdl1_fp8", "4k_pdl1_none"))]
    ratio_bars(cases, ["#4c72b0", "#55a868", "#55a868"], (7, 4),
               "llama-3.1-8b, H100, 2026-11-27: PDL (reverted: 2 of 5 FP8 runs hung)", out / "fp8_pdl_again.png")


def ratio_bars(cases: list[tuple[str, float]], colors: list[str], size: tuple[int, int], title: str, path: Path
               ) -> None:
    """FP8 / bf16 ratios (label, value) as annotated bars against the 0.6 target."""
    fig, ax = plt.subplots(figsize=size)
    bars = ax.bar([c[0] for c in cases], [c[1] for c in cases], color=colors, label="FP8 weights / bf16, same call")
    for bar, (_, value) in zip(bars, cases):
        ax.annotate(f"{value:.3f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    ax.axhline(0.6, ls="--", color="gray", label="target 0.6")
    ax.set_ylim(0.5, 0.68)
    finish(fig, ax, "FP8 / bf16 time between tokens", title, path, legend_at="upper right")


def plot_batch1_fusion(results: Path, out: Path) -> None:
    """The seventh session's batch-1 changes as FP8 / bf16 ratios, each against the bf16 run of its own call: the
    L2 prefetch of the next weight (call 1, reverted) and the RMSNorm computed by the FP8 rows kernel (call 3, A/B
    against the tree before it in the same call)."""

    def tbt(call: str, run: str) -> float:
        return one_batch_tbt_ms(results / call / run / "one_batch.json")

    prefetch_bf16, fused_bf16 = tbt("call1_prefetch", "one_batch_bs1_none"), tbt("call3_tuner_and_ab", "bs1_bf16")
    cases = [("call 1: prefetch off", tbt("call1_prefetch", "one_batch_bs1_fp8_no_prefetch") / prefetch_bf16),
             ("call 1: L2 prefetch\nof the next weight", tbt("call1_prefetch", "one_batch_bs1_fp8") / prefetch_bf16),
             ("call 3: tree before", tbt("call3_tuner_and_ab", "bs1_fp8_base") / fused_bf16),
             ("call 3: RMSNorm in\nthe FP8 rows kernel", tbt("call3_tuner_and_ab", "bs1_fp8_fused_again") / fused_bf16)]
    ratio_bars(cases, ["#8c8c8c", "#c44e52", "#8c8c8c", "#55a868"], (8, 4),
               "llama-3.1-8b, batch 1, 1k context, H100, 2026-11-27 (seventh session)", out / "fp8_batch1_fusion.png")


def plot_pdl_shipped(results: Path, out: Path) -> None:
    """The eighth session's changes as FP8 / bf16 ratios, each against the bf16 run of its own call: PDL off and on
    (calls 1, 2), then at batch 1 the epilogues fused into the FP8 rows kernel against the PDL-only tree, and the L2
    prefetch before the amax pass (reverted) against the tree without it (calls 5, 6: A/B in one call, two runs each,
    their mean)."""

    def tbt(call: str, *runs: str) -> float:
        return sum(one_batch_tbt_ms(results / call / run / "one_batch.json") for run in runs) / len(runs)

    pdl, pdl_4k = "call1_pdl_targets", "call2_pdl_4k"
    fused, prefetch = "call5_ab_fused_epilogues", "call6_ab_l2_prefetch"
    cases = [("1k, batch 1\nPDL off", tbt(pdl, "one_batch_bs1_pdl0_fp8") / tbt(pdl, "one_batch_bs1_pdl0_none")),
             ("1k, batch 1\nPDL on", tbt(pdl, "one_batch_bs1_pdl1_fp8") / tbt(pdl, "one_batch_bs1_pdl1_none")),
             ("PDL only\n(call 5)", tbt(fused, "bs1_fp8_pdl_only", "bs1_fp8_pdl_only_again") / tbt(fused, "bs1_bf16")),
             ("+ SiLU, rotary\nin the kernel", tbt(fused, "bs1_fp8_fused", "bs1_fp8_fused_again")
              / tbt(fused, "bs1_bf16")),
             ("+ L2 prefetch\n(reverted)", tbt(prefetch, "bs1_fp8_fused", "bs1_fp8_fused_again")
              / tbt(prefetch, "bs1_bf16")),
             ("4k, batch 64\nPDL off", tbt(pdl_4k, "one_batch_4k_pdl0_fp8") / tbt(pdl_4k, "one_batch_4k_pdl0_none")),
             ("4k, batch 64\nPDL on", tbt(pdl_4k, "one_batch_4k_pdl1_fp8") / tbt(pdl_4k, "one_batch_4k_pdl1_none"))]
    ratio_bars(cases, ["#8c8c8c", "#55a868", "#8c8c8c", "#55a868", "#c44e52", "#8c8c8c", "#55a868"], (11, 4),
               "llama-3.1-8b, H100, 2026-11-27 (eighth session; 4k: FP8 weights + FP8 KV)", out / "fp8_pdl_shipped.png")


def plot_amax_preload(results: Path, out: Path) -> None:
    """The ninth session's changes as FP8 / bf16 ratios, each against the bf16 run of its own call (from the logs:
    most calls' JSON files did not come back): at batch 1 the session's start, the amax parts, the first weight
    block read before the PDL wait (call 2, A/B in one call, two runs each, their mean), two blocks (call 3, not
    kept; against call 2's bf16), the shipped tree with graphs over all batch sizes (call 5); batch 64 at 4k before
    and after the amax parts were kept to few rows (calls 6, 7)."""

    def tbt(call: str, *runs: str) -> float:
        return sum(float(TBT_LINE.search((results / call / f"{run}.log").read_text())[1]) for run in runs) / len(runs)

    ab, bf16 = "call2_ab_preload", tbt("call2_ab_preload", "bs1_bf16")
    cases = [("start\n(ca26aae)", tbt(ab, "bs1_fp8_start", "bs1_fp8_start_again") / bf16),
             ("+ amax parts", tbt(ab, "bs1_fp8_parts", "bs1_fp8_parts_again") / bf16),
             ("+ first block\nbefore the wait", tbt(ab, "bs1_fp8_preload", "bs1_fp8_preload_again") / bf16),
             ("two blocks\n(not kept)", tbt("call3_two_blocks_profile", "bs1_fp8_two_blocks_again") / bf16),
             ("shipped,\n35 graphs", tbt("call5_full_capture", "bs1_fp8_again")
              / tbt("call5_full_capture", "bs1_bf16")),
             ("4k, batch 64\nparts at 64 rows", tbt("call6_4k_gpu_tests", "4k_fp8")
              / tbt("call6_4k_gpu_tests", "4k_bf16")),
             ("4k, batch 64\nshipped", tbt("call7_4k_final", "4k_fp8") / tbt("call7_4k_final", "4k_bf16"))]
    ratio_bars(cases, ["#8c8c8c", "#8c8c8c", "#55a868", "#c44e52", "#55a868", "#c44e52", "#55a868"], (11, 4),
               "llama-3.1-8b, H100, 2026-11-27 (ninth session; 4k: FP8 weights + FP8 KV)", out / "fp8_amax_preload.png")


def best_share(log: Path, prefix: str) -> float:
    """The highest "NN.N%" of the lines of a probe log starting with prefix."""
    lines = [line for line in log.read_text().splitlines() if line.startswith(prefix) and "%" in line]
    return max(float(re.search(r"([\d.]+)%", line)[1]) for line in lines)


def plot_decode_halves(results: Path, out: Path) -> None:
    """The thirteenth session's probes of the FP8-page decode kernel at batch 64 x 4k (H200): each half alone (share
    of the copy ceiling for the bytes it reads, best block shape) against the whole kernel."""
    qk, pv, whole = (results / "call7_qk_probe/qk_probe.log", results / "call8_pv_probe/pv_probe.log",
                     results / "call9_v_path_full/v_path_full.log")
    cases = [("QK: K converted\n(today)", best_share(qk, "64x4096 converted")),
             ("QK: K into an\nFP8 MMA", best_share(qk, "64x4096 FP8 MMA")),
             ("PV: V words\n(today)", best_share(pv, "64x4096 words")),
             ("PV: V bytes,\ninline PTX", best_share(pv, "64x4096 asm")),
             ("PV: V FP8 tiles\ninto the dot", best_share(pv, "64x4096 direct")),
             ("PV: bf16 V", best_share(pv, "64x4096 bf16")),
             ("whole kernel\n(today)", best_share(whole, "bs64 ctx4096 bn= 64 w=4 s=3 words=1 splits=2")),
             ("whole kernel,\nV FP8 tiles", best_share(whole, "bs64 ctx4096 bn=128 w=4 s=3 words=0"))]
    fig, ax = plt.subplots(figsize=(11, 4))
    colors = ["#55a868", "#55a868", "#c44e52", "#8c8c8c", "#8c8c8c", "#4c72b0", "#c44e52", "#8c8c8c"]
    bars = ax.bar([c[0] for c in cases], [c[1] for c in cases], color=colors, label="best block shape")
    for bar, (_, value) in zip(bars, cases):
        ax.annotate(f"{value:.0f}%", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    ax.axhline(100 / 1.15, ls="--", color="gray", label="target: 1.15x the ideal time")
    ax.set_ylim(0, 115)
    finish(fig, ax, "% of the copy ceiling (its bytes)",
           "FP8-page decode attention, llama-3.1-8b heads, batch 64 x 4k, H200, 2026-11-29",
           out / "fp8_decode_halves.png", legend_at="lower right")


def decode_us(path: Path, case: str, block_n: int, warps: int, stages: int, token_rows: bool = False) -> float:
    """The decode sweep row's microseconds for a case and block shape (at the engine's split bound: the first)."""
    rows = json.loads(path.read_text())["rows"]
    return next(r["us"] for r in rows if r["case"] == case and "us" in r and r.get("token_rows", False) == token_rows
                and (r["block_n"], r["num_warps"], r["num_stages"]) == (block_n, warps, stages))


def plot_ptx_words(results: Path, out: Path) -> None:
    """The fourteenth session (H200): the FP8-page decode kernel with V's words converted by inline PTX, at the
    head rows' shapes, against today's conversion and the token-rows loop; and the first starts with the kernels
    compiled in worker processes against in-process."""
    today, ptx = results / "call4_v_ptx/v_today.json", results / "call4_v_ptx/v_ptx.json"
    token_rows = results / "call1_token_rows/token_rows.json"
    cases = ["llama bs64 ctx4096", "llama bs32 ctx16384", "llama bs64 ctx16384", "qwen bs256 ctx600"]
    series = [("byte casts, 4 warps (before)", [decode_us(today, c, 64, 4, 3) for c in cases], "#8c8c8c"),
              ("tokens as rows (not kept)", [min(decode_us(token_rows, c, 64, 2, 3, True),
                                                 decode_us(token_rows, c, 128, 4, 2, True)) for c in cases], "#c44e52"),
              ("inline PTX, 4 warps", [decode_us(ptx, c, 64, 4, 3) for c in cases], "#4c72b0"),
              ("inline PTX, 2 warps (shipped)", [decode_us(ptx, c, 64, 2, 3) for c in cases], "#55a868")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.2
    for i, (label, values, color) in enumerate(series):
        xs = [x + (i - 1.5) * width for x in range(len(cases))]
        left.bar(xs, [v / series[0][1][j] for j, v in enumerate(values)], width, label=label, color=color)
    left.set_xticks(range(len(cases)), [c.replace(" ctx", "\n") for c in cases])
    left.set_ylim(0.8, 1.2)
    finish(fig, left, "time / before", "FP8-page decode attention (V as words), H200", out / "fp8_ptx_words.png",
           legend_at="upper left")
    starts = [("FP8, shipped table\n(one call)", 74.6, 49.1),
              ("FP8, no table\n(in-process: session 13)", 307.6, 75.5)]
    xs = range(len(starts))
    right.bar([x - 0.2 for x in xs], [s[1] for s in starts], 0.4, label="in-process compiles", color="#8c8c8c")
    right.bar([x + 0.2 for x in xs], [s[2] for s in starts], 0.4, label="compiled ahead in 8 workers", color="#55a868")
    right.axhline(60, ls="--", color="gray", label="target with the table: 60 s")
    right.set_xticks(list(xs), [s[0] for s in starts])
    finish(fig, right, "s to the first /health 200", "first start, qwen3-0.6b, empty caches",
           out / "fp8_ptx_words.png")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/2026-11-21"))
    parser.add_argument("--fp8-results", type=Path, default=Path("benchmarks/results/2026-11-27b/call3"))
    parser.add_argument("--pdl-results", type=Path, default=Path("benchmarks/results/2026-11-27d"))
    parser.add_argument("--targets-results", type=Path, default=Path("benchmarks/results/2026-11-27e"))
    parser.add_argument("--pdl-again-results", type=Path, default=Path("benchmarks/results/2026-11-27f"))
    parser.add_argument("--batch1-results", type=Path, default=Path("benchmarks/results/2026-11-27g"))
    parser.add_argument("--pdl-shipped-results", type=Path, default=Path("benchmarks/results/2026-11-27h"))
    parser.add_argument("--amax-preload-results", type=Path, default=Path("benchmarks/results/2026-11-27i"))
    parser.add_argument("--decode-halves-results", type=Path, default=Path("benchmarks/results/2026-11-29"))
    parser.add_argument("--ptx-words-results", type=Path, default=Path("benchmarks/results/2026-11-29b"))
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for plot in (plot_offline, plot_decode, plot_kv_transfer, plot_pd_ttft):
        plot(args.results, args.out)
    plot_fp8_decode(args.fp8_results, args.out)
    plot_fp8_pdl(args.pdl_results, args.out)
    plot_fp8_steps(args.targets_results, args.out)
    plot_pdl_again(args.pdl_again_results, args.out)
    plot_batch1_fusion(args.batch1_results, args.out)
    plot_pdl_shipped(args.pdl_shipped_results, args.out)
    plot_amax_preload(args.amax_preload_results, args.out)
    plot_decode_halves(args.decode_halves_results, args.out)
    plot_ptx_words(args.ptx_words_results, args.out)


if __name__ == "__main__":
    main()
