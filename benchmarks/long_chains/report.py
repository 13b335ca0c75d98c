"""The long-chain benchmark's report (benchmarks/long_chains/sweep.py): the rows as a table, the peak-memory plot,
and the memory model fitted on them (bytes per token per provider, extrapolated to 7-8B models on an 80 GB H100).
Reads the CSV only; `python benchmarks/long_chains/sweep.py --plot-only` rebuilds it."""

import csv
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results" / "long_chains"

PROVIDERS = ("trl_ckpt", "trl_nockpt", "trl_rowfold", "fused_trl", "fused_trl_packed", "gk_none", "gk_blocks",
             "gk_auto", "gk_selective", "gk_tiled", "gk_sp")  # every provider long_chains.py measures, report order


def _csv_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))




# Qwen2.5-7B (config.json): 28 layers, hidden 3584, MLP 18944, 28 query / 4 KV heads of 128, vocab 152064.
QWEN7B = dict(layers=28, hidden=3584, intermediate=18944, params=7.62e9)
# Llama-3.1-8B (config.json): 32 layers, hidden 4096, MLP 14336, 32 query / 8 KV heads of 128, vocab 128256.
LLAMA8B = dict(layers=32, hidden=4096, intermediate=14336, params=8.03e9)
# ALST (Arctic Long Sequence Training, Snowflake, 2025), Llama-8B on H100s: the longest sequence it trains.
ALST_TOKENS = {1: "500k (1 GPU)", 8: "3.7M (8 GPUs)"}
H100_GB = 80.0


def fit(rows: list[dict], min_tokens: int = 0) -> dict:
    """{provider: (bytes per token, static MB)}: least squares of peak RSS on tokens computed, over the provider's
    ok rows of the length and step sweeps (and spread) of at least min_tokens tokens."""
    out = {}
    for provider in PROVIDERS:
        pts = [(float(r["computed_tokens"]), float(r["peak_rss_mb"])) for r in rows
               if r["provider"] == provider and r["status"] == "ok" and float(r["computed_tokens"]) >= min_tokens
               and r["sweep"] != "longest"]  # a longest-chain row's peak is one micro-batch's, not the step's
        if len({x for x, _ in pts}) < 2:
            continue
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out[provider] = (slope * 2**20, my - slope * mx)
    return out


def memory_model(rows: list[dict], config: dict) -> str:
    """Markdown: the fitted bytes/token and the extrapolation to Qwen2.5-7B bf16 on 80 GB GPUs (a model)."""
    fits = fit(rows)
    if not fits:
        return "\n".join(["No provider has two measured points: no memory model.", "", *longest_table(rows)])
    layers, hidden, inter = config["layers"], config["hidden"], config["intermediate"]
    scale = (QWEN7B["layers"] * (QWEN7B["hidden"] + QWEN7B["intermediate"])) / (layers * (hidden + inter)) * 0.5
    # Static memory per GPU under FSDP2 over 8 GPUs: bf16 params + fp32 master weights, fp32 gradients and two Adam
    # moments = 18 bytes per parameter, sharded 8 ways; plus one unsharded bf16 block in flight (small).
    static_gb = QWEN7B["params"] * 18 / 8 / 2**30
    lines = [
        "# Memory model (fitted on the measured rows; the 7B columns are an extrapolation, not a measurement)",
        "",
        f"Measured model: {layers} layers, hidden {hidden}, MLP {inter}, fp32. Per provider, peak RSS = static + "
        "bytes/token x tokens computed per step (least squares over its measured rows).",
        f"Extrapolation to Qwen2.5-7B in bf16: bytes/token scaled by layers x (hidden + MLP) "
        f"({QWEN7B['layers']} x ({QWEN7B['hidden']} + {QWEN7B['intermediate']}) / ({layers} x ({hidden} + {inter}))) "
        f"and by 0.5 for bf16 = x{scale:.1f}; static {static_gb:.1f} GB per GPU (FSDP2 over 8 GPUs: 18 bytes per "
        f"parameter: bf16 weights, fp32 master, gradients and two Adam moments); {H100_GB:.0f} GB per GPU. "
        "With SP = N, a GPU holds 1/N of the tokens' activations. Longest chain = the tokens per GPU that fit, for one "
        "completion per micro-batch.",
        "",
        "| provider | bytes/token (measured) | static MB (measured) | 7B bytes/token (model) | longest chain per "
        "GPU, SP=1 (model) | SP=2 | SP=4 | SP=8 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    free = (H100_GB - static_gb) * 2**30
    for provider, (per_token, static) in fits.items():
        b7 = per_token * scale
        chains = [f"{free * n / b7 / 1e3:.0f}k" if b7 > 0 else "-" for n in (1, 2, 4, 8)]
        if not provider.startswith("gk_") or provider == "gk_sp":  # SP is the trainer's; gk_sp is measured per rank
            chains[1:] = ["-"] * 3
        lines.append(f"| {provider} | {per_token / 1e3:.1f} kB | {static:.0f} | {b7 / 1e6:.2f} MB | "
                     + " | ".join(chains) + " |")  # fmt: skip
    lines += ["", "gk_sp's slope is a rank's peak over the whole row's tokens (each rank computes 1/N): it checks "
              "the "
              "SP columns of gk_blocks (about 1/N of gk_blocks' slope expected). Attention's own working memory (SDPA "
              "per sequence) is in the measured slopes (the allocator's retained heap is not, with the mmap threshold "
              "the rows record); GPU attention kernels need "
              "less than the CPU path measured here. The static term on CPU includes the Python process, torch and "
              "the model's fp32 weights, gradients and Adam moments.", ""]
    if "trl_rowfold" in fits:
        lines[-1:-1] = ["", "trl_ckpt is TRL on the CPU, where its LM head folds each 4,096-token tile with whole-tile "
                        "fp32 temporaries: a fixed amount per tile, which lowers its slope and raises its static term. "
                        "trl_rowfold is TRL with that fold run 128 rows at a time (its memory where its Triton head "
                        "kernel runs on a GPU), fitted on the equal-length pairs runs "
                        "(long_chains_pairs_rep<N>_<model>.csv, another machine's rows: peaks, not times): the TRL "
                        "row to set beside ours, and its 7B columns are TRL's on a GPU as far as this model goes."]
    return "\n".join(lines + component_model(rows, config) + floor_bound(rows, config) + longest_table(rows))


def longest_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per provider, the longest single chain measured to fit and the shortest that did not."""
    out = []
    for provider in PROVIDERS:
        mine = [r for r in rows if r["provider"] == provider and r["sweep"] == "longest"]
        if not mine:
            continue
        fit = [int(r["max_len"]) for r in mine if r["status"] == "ok"]
        over = [int(r["max_len"]) for r in mine if r["status"] != "ok"]
        peak = next((r["peak_rss_mb"] for r in mine if fit and int(r["max_len"]) == max(fit)), "")
        caps = "/".join(sorted({str(r["cap_mb"]) for r in mine}))
        out.append(f"| {provider} | {max(fit) if fit else 0} | {peak} | {min(over) if over else '-'} | {caps} |")
    if not out:
        return []
    return ["## The longest single chain (measured: one completion per micro-batch, under the cap)", "",
            "A \"-\" in the shortest that did not: every length tried fitted (the search stopped at its limit).", "",
            "| provider | longest that fits (tokens) | its peak MB | shortest that did not | cap MB (per rank) |",
            "|---|---:|---:|---:|---:|", *out, ""]  # fmt: skip


COMPONENT_MIN_TOKENS = 8000  # below, a step's peak is set by other phases (the flat start of every provider's line)


def component_model(rows: list[dict], config: dict) -> list[str]:
    """Markdown lines: a model of the longest chain per 80 GB GPU for Qwen2.5-7B and Llama-8B in bf16 with block
    checkpointing, the tiled MLP and offloaded checkpoints, from components fitted on the measured model (its rows
    of at least COMPONENT_MIN_TOKENS tokens)."""
    fits = fit(rows, COMPONENT_MIN_TOKENS)
    if "gk_blocks" not in fits or "gk_tiled" not in fits:
        return ["No gk_blocks and gk_tiled fits: no component model.", ""]
    layers, hidden, inter = config["layers"], config["hidden"], config["intermediate"]
    floor = layers * hidden * 4  # fp32 bytes per token of the checkpointed block inputs
    mlp = (fits["gk_blocks"][0] - fits["gk_tiled"][0]) / (inter * 4)  # per token, in intermediate-size floats
    rest = (fits["gk_tiled"][0] - floor) / (hidden * 4)  # the rest of one block's working set, in hidden-size floats
    lines = ["## Components and the longest chain with the tiled MLP and offloaded checkpoints (a model)", "",
             f"Fitted on the rows of at least {COMPONENT_MIN_TOKENS} tokens (gk_blocks "
             f"{fits['gk_blocks'][0] / 1e3:.1f} kB, gk_tiled {fits['gk_tiled'][0] / 1e3:.1f} kB per token): the "
             f"checkpointed block inputs are {floor / 1e3:.1f} kB per token ({layers} x "
             f"{hidden} fp32: the floor); the tiled MLP removes {mlp:.2f} x intermediate size floats per token "
             f"(gk_blocks - gk_tiled); the rest of one block's working set is {rest:.2f} x hidden size floats per "
             "token (gk_tiled - floor). Scaled to a model in bf16 (2 bytes), per token and GPU: floor (layers x hidden "
             "x 2; 0 with offload: the block inputs are in host memory, which must hold them) + rest x hidden x 2 + "
             "(mlp x intermediate x 2 unless tiled); with SP = N a GPU holds 1/N of the tokens. 8 GPUs, FSDP2 over "
             "all 8 (18 bytes per parameter / 8 static), 80 GB each; the fused head keeps no logits. Not modelled: "
             "attention kernels' own buffers, the all-to-all buffers of SP, fragmentation. One GPU does not fit the "
             "optimizer state of these models (18 bytes x 8B parameters = 144 GB): this trainer keeps it on the "
             "device, so ALST's one-GPU row has no counterpart here.", "",
             "Offload moves the floor to the host: with every GPU full, a node of 8 holds 8 x (SP=1 chain) tokens "
             "whatever N, so its host memory must hold that many tokens' block inputs (the host memory column): at "
             "these lengths the host memory of a node (commonly 1-2 TB) binds before the GPUs do.", "",
             "| model | mode | bytes/token (model) | SP=1 | SP=2 | SP=4 | SP=8 | host memory per node "
             "| ALST, published |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, m in (("Qwen2.5-7B", QWEN7B), ("Llama-8B", LLAMA8B)):
        free = (H100_GB - m["params"] * 18 / 8 / 2**30) * 2**30
        for mode, offload, tiled in (("blocks", False, False), ("blocks + tiled MLP", False, True),
                                     ("offload + tiled MLP", True, True)):  # fmt: skip
            per_token = (0 if offload else m["layers"] * m["hidden"] * 2) + rest * m["hidden"] * 2
            per_token += 0 if tiled else mlp * m["intermediate"] * 2
            chains = [_tokens(free * n / per_token) for n in (1, 2, 4, 8)]
            alst = ALST_TOKENS[8] if name == "Llama-8B" and offload else ""
            host = f"{8 * free / per_token * m['layers'] * m['hidden'] * 2 / 1e12:.1f} TB" if offload else "-"
            lines.append(f"| {name} | {mode} | {per_token / 1e3:.0f} kB | " + " | ".join(chains)
                         + f" | {host} | {alst} |")  # fmt: skip
    return lines + [""]


def floor_bound(rows: list[dict], config: dict, length: int = 4000, group: int = 8) -> list[str]:
    """Markdown lines: at one measured point (group x length, the length sweep), how far block-input checkpoints can
    go below TRL's peak on this machine: the measured static memory plus the floor alone, against TRL's and ours."""
    at = {r["provider"]: r for r in rows if r["sweep"] == "length" and r["status"] == "ok"
          and int(r["group_size"]) == group and int(r["min_len"]) == int(r["max_len"]) == length}  # fmt: skip
    if "trl_ckpt" not in at or "gk_tiled" not in at:
        return []
    trl, ours = float(at["trl_ckpt"]["peak_rss_mb"]), at["gk_tiled"]
    rowfold = float(at["trl_rowfold"]["peak_rss_mb"]) if "trl_rowfold" in at else None
    floor_mb = config["layers"] * config["hidden"] * 4 * float(ours["computed_tokens"]) / 2**20
    static, peak = float(ours["base_rss_mb"]), float(ours["peak_rss_mb"])
    bound = static + floor_mb
    return [f"## How low block checkpoints can go ({group} x {length}, measured)", "",
            f"TRL (checkpointing on) peaks at {trl:.0f} MB, ours with the tiled MLP at {peak:.0f} MB "
            f"({peak / trl:.2f}x)"
            + (f"; TRL without its CPU fold peaks at {rowfold:.0f} MB (ours {peak / rowfold:.2f}x of it)"
               if rowfold else "") + f". Of ours, {static:.0f} MB are there before the step (weights, gradients, Adam "
            f"moments, the process: RSS after a warm-up step) and {floor_mb:.0f} MB are the checkpointed block "
            f"inputs of its {int(ours['computed_tokens'])} tokens (the floor): {bound:.0f} MB, {bound / trl:.2f}x "
            f"TRL's peak with no working memory at all; the working set above them is {peak - bound:.0f} MB. Below "
            "that bound only fewer or smaller block inputs go (offload on a GPU moves them to host memory; on the CPU "
            "they are in it already).", ""]  # fmt: skip


def _tokens(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def report(csv_path: Path) -> None:
    rows = _csv_rows(csv_path)
    if not rows:
        print(f"no rows in {csv_path}")
        return
    print("\n| sweep | G | lengths | provider | status | peak MB | step s | tokens/s | padding |")
    print("|---|---:|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['sweep']} | {r['group_size']} | {r['min_len']}-{r['max_len']} | {r['provider']} | {r['status']} | "
              f"{r['peak_rss_mb']} | {r['step_s']} | {r['tokens_per_s']} | {r['padding_fraction']} |")  # fmt: skip
    config = _model_config(rows[-1]["model"])
    # beside the committed CSVs, memory_model.md is the main CSV's fit (a side sweep's CSV there has fewer providers)
    side = csv_path.resolve().parent == RESULTS and csv_path.name != f"long_chains_{rows[-1]['model']}.csv"
    if config is not None and not side:  # with TRL without its CPU fold from the pairs runs beside it
        extra = [r for r in _pairs_rows(csv_path.parent, rows[-1]["model"]) if r["provider"] == "trl_rowfold"]
        (csv_path.parent / "memory_model.md").write_text(memory_model(rows + extra, config))
    elif side and longest_table(rows):  # a side sweep of longest chains (e.g. under another cap): its own table
        csv_path.with_suffix(".md").write_text("\n".join([f"Rows: {csv_path.name}.", "", *longest_table(rows)]))
    if side and csv_path.name.startswith("long_chains_pairs_rep"):  # one repeat of the back-to-back pairs
        path = pairs_report(csv_path.parent, rows[-1]["model"])
        print(f"wrote {path}")
        return  # one point per file: no plot
    if any(r["sweep"] != "longest" and r["status"] == "ok" for r in rows):  # the plot has no longest rows
        _plot(rows, csv_path.with_suffix(".png"))


PAIRS = ("trl_ckpt", "trl_rowfold", "gk_blocks", "gk_auto")  # the back-to-back providers of a pairs run
# the columns pairs_report reads (long_chains.COLUMNS has them all)
COLUMNS_PAIRS = ("timestamp", "device", "provider", "sweep", "min_len", "max_len", "step_s", "peak_rss_mb",
                 "computed_tokens", "load_before", "status")
PAIR_RATIOS = (("gk_blocks", "trl_ckpt"), ("gk_blocks", "trl_rowfold"), ("gk_auto", "trl_ckpt"),
               ("gk_auto", "trl_rowfold"))  # fmt: skip


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    mid = values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    return f"{mid:.2f}x ({values[0]:.2f}-{values[-1]:.2f})" if len(values) > 1 else f"{values[0]:.2f}x"


def _pairs_rows(directory: Path, model: str) -> list[dict]:
    """The ok equal-length rows of every long_chains_pairs_rep<N>_<model>.csv in directory, each with its "rep"."""
    out = []
    for path in sorted(directory.glob(f"long_chains_pairs_rep*_{model}.csv")):
        rep = path.name[len("long_chains_pairs_rep") :].split("_", 1)[0]
        out += [dict(r, rep=rep) for r in _csv_rows(path)
                if r["status"] == "ok" and r["sweep"] == "length" and r["min_len"] == r["max_len"]]  # fmt: skip
    return out


def pairs_report(directory: Path, model: str) -> Path:
    """long_chains_pairs_<model>.md from every long_chains_pairs_rep<N>_<model>.csv in directory: per equal length
    and repeat (one run of the providers back to back), the step times, peaks and time ratios of ours to TRL and to
    TRL without its CPU fold (trl_rowfold); then per length the median and range of each ratio over the repeats.
    A ratio is only taken within one repeat: the machine's speed moves between runs."""
    reps = {}  # (length, rep) -> {provider: row}
    for r in _pairs_rows(directory, model):
        reps.setdefault((int(r["max_len"]), r["rep"]), {})[r["provider"]] = r
    lines = [f"# Equal-length steps back to back, {model}: ours against TRL and TRL without its CPU fold", "",
             "Rows: long_chains_pairs_rep<N>_<model>.csv, one run of `python -m benchmarks.long_chains.sweep "
             "--sweeps length "
             "--providers trl_ckpt,trl_rowfold,gk_blocks,gk_auto --min-len L --max-len L --cap-gb 12 --csv ...` each "
             "(G = 8, one micro-batch holds the step). A ratio compares rows of one run; load: the highest 1-minute "
             "load before a row of the run (above 1: other work shared the cores). trl_rowfold: TRL with its LM "
             "head's CPU fold run 128 rows at a time, TRL's memory where its Triton head kernel runs.", "",
             "| L | rep | device | measured | load | TRL s | rowfold s | blocks s | auto s | blocks vs TRL | "
             "blocks vs rowfold | auto vs TRL | auto vs rowfold | peak MB: TRL / rowfold / blocks / auto |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    ratios = {}  # (length, ours, base) -> [ratio per repeat]
    for (length, rep), got in sorted(reps.items()):
        step = {p: float(got[p]["step_s"]) for p in PAIRS if p in got}
        cells = []
        for ours, base in PAIR_RATIOS:
            if ours in step and base in step:
                ratios.setdefault((length, ours, base), []).append(step[ours] / step[base])
                cells.append(f"{step[ours] / step[base]:.2f}x")
            else:
                cells.append("-")
        first = min(r["timestamp"] for r in got.values())
        lines.append(f"| {length} | {rep} | {next(iter(got.values()))['device']} | {first[:16].replace('T', ' ')} | "
                     f"{max(float(r['load_before']) for r in got.values()):.2f} | "
                     + " | ".join(f"{step[p]:.1f}" if p in step else "-" for p in PAIRS) + " | " + " | ".join(cells)
                     + " | " + " / ".join(got[p]["peak_rss_mb"] if p in got else "-" for p in PAIRS) + " |")
    lines += ["", "Per length over the repeats: the median step-time ratio (its range).", "",
              "| L | repeats | " + " | ".join(f"{o.split('_')[1]} vs {'TRL' if b == 'trl_ckpt' else 'rowfold'}"
                                              for o, b in PAIR_RATIOS) + " |",
              "|---:|---:|" + "---:|" * len(PAIR_RATIOS)]  # fmt: skip
    for length in sorted({n for n, _ in reps}):
        count = sum(1 for n, _ in reps if n == length)
        lines.append(f"| {length} | {count} | "
                     + " | ".join(_span(ratios.get((length, o, b), [])) for o, b in PAIR_RATIOS) + " |")
    every = [r for got in reps.values() for r in got.values()]
    # gk_auto checkpoints another number of blocks at each L: its peaks are not one line
    slopes = {provider: v for provider, v in fit(every).items() if provider != "gk_auto"}
    if slopes:  # a peak is the same in every run (unlike a time): fitted over all the repeats' rows
        lines += ["", "Peak memory against tokens computed per step, least squares over every L and repeat (how the "
                  "memory model fits; TRL without its CPU fold is TRL's memory where its Triton head kernel runs):",
                  "", "| provider | kB per token | static MB | rows |", "|---|---:|---:|---:|"]  # fmt: skip
        for provider, (per_token, static) in slopes.items():
            count = sum(1 for r in every if r["provider"] == provider)
            lines.append(f"| {provider} | {per_token / 1e3:.1f} | {static:.0f} | {count} |")
    path = directory / f"long_chains_pairs_{model}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _model_config(name: str) -> dict | None:
    if name == "tiny":
        return dict(layers=2, hidden=128, intermediate=256)
    if name == "smollm2-135m":
        return dict(layers=30, hidden=576, intermediate=1536)
    return None


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for provider in PROVIDERS:
        pts = sorted((int(r["computed_tokens"]), float(r["peak_rss_mb"]) / 1024) for r in rows
                     if r["provider"] == provider and r["status"] == "ok" and r["sweep"] != "longest")  # fmt: skip
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=provider)
    cap = max(float(r["cap_mb"]) for r in rows) / 1024
    ax.axhline(cap, color="gray", linestyle="--", linewidth=1, label=f"cap {cap:.0f} GB")
    ax.set_xscale("log")
    ax.set_xlabel("tokens computed per step (padding included)")
    ax.set_ylabel("peak RSS per process (GB)")
    ax.set_title(f"One GRPO step, {rows[-1]['model']}, fp32, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
