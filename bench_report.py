"""What bench.py reports: a run's counters, the median run's figures, the speed-ups, the paper's
theory beside them (`theory`: how each of its terms is measured), the tables, the SSD / SD grid,
the hardware and the plot.

bench.py measures (prompts, configurations, the engines' runs, the tuner, the command line): each
generate() of a run becomes `counters`, summed over the run's batches by `add_counters`;
`summarize` turns a configuration's runs into a row (the JSON's "results"), `add_speedups` and
`add_theory` complete the rows, and `print_tables`, `print_grid` and `plot` show them. Nothing
here runs a model, nor imports bench.py.
"""
import os
import platform
import statistics
from dataclasses import asdict, dataclass

import torch

from fallback import critical_batch_size, predicted_sd_speedup, predicted_speedup
from engine import default_devices


# --------------------------------------------------------------------------------------------------
# Counters: what a run sums over its batches

def counters(cfg, s: dict) -> dict:
    """One generate()'s stats (cfg: a bench.Config) -> the counters a run sums over its batches
    (add_counters)."""
    hist = s["accept_len_histogram"]
    c = dict(new=s["new_tokens"],
             first=s["batch"],  # the first token of each row comes from the prefill
             decode_s=s["decode_seconds"], prefill_s=s["prefill_seconds"],
             verify_s=s["verify_seconds"], rounds=s["rounds"], row_rounds=sum(hist),
             accepted=sum(j * h for j, h in enumerate(hist)), proposed=s["proposed_tokens"],
             # for the paper's per-token a (capped-geometric MLE): accepted / trials
             trials=s["acceptance_trials"], hist=list(hist),
             hits=0, misses=0, tok_hit=0, tok_miss=0, rounds_hit=0, rounds_miss=0, wait_s=0.0,
             busy_s=0.0, fallback_rounds={}, b_star=None, hits_per_depth=[], lookups_per_depth=[],
             stopped=0, skipped=0, pre_rounds=0, budget_sum=0, guesses_per_depth=[],
             rows_guessed=0)
    if cfg.engine == "ssd":
        # the tokens of row-rounds that hit and of the others (a round that pre-speculated nothing
        # looked nothing up: it is no miss of the cache's, yet a round the fallback proposed)
        (tok_hit, tok_miss), (rounds_hit, rounds_miss) = (s["tokens_hit_miss"],
                                                          s["row_rounds_hit_miss"])
        c.update(hits=s["hits"], misses=s["misses"], tok_hit=tok_hit, tok_miss=tok_miss,
                 rounds_hit=rounds_hit, rounds_miss=rounds_miss,
                 wait_s=s["verifier_wait_seconds"], busy_s=s["draft_busy_seconds"],
                 fallback_rounds=dict(s["fallback_rounds"]), b_star=s["b_star"],
                 hits_per_depth=list(s["hits_per_depth"]),
                 lookups_per_depth=list(s["lookups_per_depth"]),
                 # per pre-speculation decision (a batch's round 0 has one too): made or skipped
                 stopped=s["pre_speculation_stopped"], skipped=s["pre_speculation_skipped"],
                 pre_rounds=s["pre_speculations"], budget_sum=s["budget_sum"],
                 guesses_per_depth=list(s["guesses_per_depth"]), rows_guessed=s["rows_guessed"])
    return c


def add_counters(x: dict, y: dict) -> dict:
    """The counters of one configuration over two sets of batches -> over both: numbers and lists
    add (lists elementwise), dicts add per key, b* is the later one's."""
    out = {}
    for k, v in x.items():
        w = y[k]
        if k == "b_star":
            out[k] = w
        elif k == "tokens":  # each row's tokens: the batches' rows one after the other
            out[k] = v + w
        elif isinstance(v, dict):
            out[k] = {n: v.get(n, 0) + w.get(n, 0) for n in v.keys() | w.keys()}
        elif isinstance(v, list):
            out[k] = [p + q for p, q in zip(v, w)] if v and w else list(v or w)
        else:
            out[k] = v + w
    return out


# --------------------------------------------------------------------------------------------------
# Summaries: the median run, its figures

def summarize(cfg, runs):
    """A configuration's runs (cfg: a bench.Config) -> the median run's figures (by decode tok/s;
    the lower middle run for an even count)."""
    speeds = [(r["new"] - r["first"]) / r["decode_s"] for r in runs]
    m = runs[speeds.index(statistics.median_low(speeds))]
    tok_s = (m["new"] - m["first"]) / m["decode_s"]
    settings = asdict(cfg)
    spec = settings.pop("spec")  # its fields as the row's own: k (0 without a draft), fan_out, ...
    K = spec.pop("K")  # the draft's; an engine without one reports k = 0 (and no K)
    row = {**settings, "k": K if cfg.engine in ("sd", "ssd", "hf-assisted") else 0, **spec,
           "runs_tok_s": speeds, "decode_tok_s": tok_s,
           "tokens": m.get("tokens"),  # this engine's (add_agreement reads, then drops them)
           "decode_tok_s_per_seq": tok_s / cfg.batch, "decode_seconds": m["decode_s"],
           "prefill_seconds": m["prefill_s"], "new_tokens": m["new"]}
    if "rounds" in m:  # this engine's counters
        rr = m["row_rounds"]
        row.update(rounds=m["rounds"], row_rounds=rr, accept_len_histogram=m["hist"],
                   verify_seconds=m["verify_s"],
                   tokens_per_round=(m["new"] - m["first"]) / rr if rr else 0.0,
                   accepted_per_proposed=m["accepted"] / m["proposed"] if m["proposed"] else None,
                   acceptance_a=m["accepted"] / m["trials"] if m["trials"] else None)
    if cfg.engine == "ssd":
        looks = m["hits"] + m["misses"]
        row_rounds = m["rounds_hit"] + m["rounds_miss"]
        row.update(hits=m["hits"], misses=m["misses"],
                   cache_hit_rate=m["hits"] / looks if looks else 0.0,
                   # a round that pre-speculated nothing (pre_spec auto / never) looks nothing up
                   # and is a miss: the share of row-rounds that hit is the theory's p_hit
                   hit_share=m["rounds_hit"] / row_rounds if row_rounds else 0.0,
                   tokens_per_round_hit=m["tok_hit"] / m["rounds_hit"] if m["rounds_hit"] else 0.0,
                   tokens_per_round_miss=(m["tok_miss"] / m["rounds_miss"] if m["rounds_miss"]
                                          else 0.0),
                   verifier_wait_seconds=m["wait_s"], draft_busy_seconds=m["busy_s"],
                   verifier_wait_pct=100 * m["wait_s"] / m["decode_s"],
                   draft_busy_pct=100 * m["busy_s"] / m["decode_s"],
                   fallback_rounds=m["fallback_rounds"], b_star=m["b_star"],
                   # stopped: of the pre-speculations made; skipped: of the decisions
                   stopped_pct=100 * m["stopped"] / max(m["pre_rounds"], 1),
                   skipped_pct=100 * m["skipped"] / max(m["pre_rounds"] + m["skipped"], 1),
                   mean_budget=m["budget_sum"] / max(m["pre_rounds"], 1),
                   hits_per_depth=m["hits_per_depth"], lookups_per_depth=m["lookups_per_depth"],
                   # the fan-out actually used: mean F_j per row-round guessed (round 0 included)
                   row_fan_out_mean=[g / max(m["rows_guessed"], 1) for g in m["guesses_per_depth"]])
    return row


def find(rows, engine, like, threads=None, k=None):
    """The row of `engine` at the same temperature, batch and weights (quant) as `like` (and
    threads / K if given; with K, the same confidence stop); a peer's row (no quant) finds this
    engine's first."""
    for r in rows:
        if (r["engine"] == engine and r["temperature"] == like["temperature"]
                and r["batch"] == like["batch"] and (threads is None or r["threads"] == threads)
                and (k is None or (r["k"], r["confidence"]) == (k, like["confidence"]))
                and (not like.get("quant") or r.get("quant") == like["quant"])):
            return r
    return None


def add_agreement(rows):
    """Greedy SD and SSD emit exactly AR's tokens (the same target, its threads and weights): each
    such row gets same_tokens_as_ar, the share of prompts whose tokens are AR's. Below 1 the row
    did not measure the same output: a compiled step can flip a near-tie (model.compiled_body),
    a systematic difference is a bug (one made compiled SD verify wrongly after compiled AR, and
    nothing here had looked). The tokens themselves leave the rows (not in the JSON)."""
    for r in rows:
        ar = find(rows, "ar", r, r["threads"])
        if (r["temperature"] == 0 and r["engine"] in ("sd", "ssd") and ar
                and r.get("tokens") and ar.get("tokens")):
            same = [x == y for x, y in zip(r["tokens"], ar["tokens"])]
            r["same_tokens_as_ar"] = sum(same) / len(same)
    for r in rows:
        r.pop("tokens", None)


def add_speedups(rows):
    """Speed-up vs this engine's AR and SD with the same target threads (and the same K for SD)."""
    for r in rows:
        ar = find(rows, "ar", r, r["threads"])
        sd = find(rows, "sd", r, r["threads"], r["k"] or None)
        r["speedup_vs_ar"] = r["decode_tok_s"] / ar["decode_tok_s"] if ar else None
        r["speedup_vs_sd"] = (r["decode_tok_s"] / sd["decode_tok_s"]
                              if sd and r["engine"] != "ar" else None)
        # repeat i of every configuration ran in the same pass, side by side: their ratio shows the
        # run-to-run spread without the machine's drift between passes
        r["speedup_vs_sd_runs"] = ([x / y for x, y in zip(r["runs_tok_s"], sd["runs_tok_s"])]
                                   if sd and r["engine"] != "ar" else None)
        # against the peer's fastest row (llama.cpp on the same file, AR, batch 1)
        peer = [x["decode_tok_s"] for x in rows if x["engine"] == "llama.cpp"
                and x["temperature"] == r["temperature"] and x["batch"] == r["batch"]]
        r["speedup_vs_llama_cpp"] = r["decode_tok_s"] / max(peer) if peer else None


# --------------------------------------------------------------------------------------------------
# Theory: the paper's predicted speed-up beside the measured one

@dataclass
class Measured:
    """What the theory needs, measured in one sweep (seconds unless said otherwise).

    T_ar          AR's decode time per round at this batch, with ssd's target threads: the unit
                  of time ("plain decoding" costs 1 per token).
    sd_round      SD's decode time per round (same threads, same K); E_sd its tokens per round;
                  sd_verify the verification's share of it (None: assume one AR step).
    verify_s      ssd's verifications (the target's forward and accept/reject), in all.
    rounds        ssd's rounds (of the whole batch); decode_s, wait_s, busy_s its decode time, the
                  verifier's wait for proposals, the speculator's busy time (pre-speculation +
                  answering + fallback).
    neural_rounds ssd rounds whose misses used the neural backup; fast_rounds, n-gram / random.
    p_hit, E_hit, E_miss  cache hit rate per sequence, tokens per round after a hit / a miss.
    b             batch size; E_f tokens per round of a fast backup (None: fallback.py's
                  default)."""
    T_ar: float
    rounds: int
    decode_s: float
    wait_s: float
    busy_s: float
    p_hit: float
    E_hit: float
    E_miss: float
    b: int = 1
    neural_rounds: int = 0
    fast_rounds: int = 0
    sd_round: float | None = None
    E_sd: float | None = None
    sd_verify: float | None = None
    verify_s: float | None = None
    E_f: float | None = None


def theory(m: Measured) -> dict:
    """The terms of Theorem 7 / Corollary 16 from measurements, and the speed-ups they predict
    over AR. Times in units of T_ar (why each is measured so: docs/design.md section 10):
      c_SD = sd_verify / T_ar                         SD's verification, in AR steps (1 if unknown)
      T_SD = sd_round / T_ar - c_SD                   SD's drafting (and its bookkeeping) per round
      T_b  = T_SD on neural fallback rounds (without an SD row: the verifier's wait per fallback
             round), 0 on n-gram / random ones; averaged over the fallback rounds
      T_p  = (busy_s - neural_rounds T_SD T_ar) / rounds / T_ar   building the next round's cache
      c    = (decode_s - wait_s) / rounds / T_ar      the ssd verifier's own time per round
      c_v  = verify_s / rounds / T_ar                 of which its verification: against c_SD, what
                                                      running beside the speculator costs it
    Returns those and ssd_pred (the paper's formula, c = 1), ssd_pred_c (with the measured c),
    sd_pred = E_SD / (1 + T_SD) (the paper's, c_SD = 1), sd_bound = (c_SD + T_SD) / c, SD's round
    over the ssd verifier's (the most SSD can gain over SD) and
    b_star (fallback.critical_batch_size from the same p_hit, E_hit, T_p, its default T_f and the
    neural backup's time T_SD; in the verifier's rounds, c, the unit it takes)."""
    c_sd = m.sd_verify / m.T_ar if m.sd_verify else 1.0
    T_sd = m.sd_round / m.T_ar - c_sd if m.sd_round else None
    fb_rounds = m.neural_rounds + m.fast_rounds
    if T_sd is not None:
        backup_s = T_sd * m.T_ar
    else:
        backup_s = m.wait_s / fb_rounds if fb_rounds else 0.0
    T_b = m.neural_rounds * backup_s / fb_rounds / m.T_ar if fb_rounds else 0.0
    T_p = max(0.0, m.busy_s - m.neural_rounds * backup_s) / m.rounds / m.T_ar
    c = (m.decode_s - m.wait_s) / m.rounds / m.T_ar
    pred = predicted_speedup(m.p_hit, m.E_hit, m.E_miss, T_p, T_b, m.b)
    pred_c = predicted_speedup(m.p_hit, m.E_hit, m.E_miss, T_p / c, T_b / c, m.b) / c
    return {"T_p": T_p, "T_b": T_b, "T_SD": T_sd, "c": c, "ssd_pred": pred, "ssd_pred_c": pred_c,
            "c_SD": c_sd if m.sd_round and m.sd_verify else None,
            "c_v": m.verify_s / m.rounds / m.T_ar if m.verify_s else None,
            "sd_bound": (c_sd + T_sd) / c if T_sd is not None and c > 0 else None,
            "sd_pred": (predicted_sd_speedup(m.E_sd, T_sd)
                        if T_sd is not None and m.E_sd else None),
            "b_star": critical_batch_size(m.p_hit, m.E_hit, T_p / c, m.E_f, None,
                                          None if T_sd is None else T_sd / c)}


def add_theory(rows):
    """A theory dict on every ssd row that has its same-thread AR row (and SD row, when
    measured)."""
    for r in rows:
        ar = find(rows, "ar", r, r["threads"])
        if r["engine"] != "ssd" or not ar or not r["rounds"]:
            continue
        sd = find(rows, "sd", r, r["threads"], r["k"])
        fast = [x for x in rows
                if x["engine"] == "ssd" and x["temperature"] == r["temperature"]
                and x["k"] == r["k"] and x["batch"] == r["batch"]
                and x["fallback"] in ("ngram", "random") and x["misses"]]
        fr = r["fallback_rounds"]
        r["theory"] = theory(Measured(
            T_ar=ar["decode_seconds"] / ar["rounds"], rounds=r["rounds"],
            decode_s=r["decode_seconds"], wait_s=r["verifier_wait_seconds"],
            busy_s=r["draft_busy_seconds"], p_hit=r["hit_share"],
            E_hit=r["tokens_per_round_hit"] or r["tokens_per_round"],
            E_miss=r["tokens_per_round_miss"], b=r["batch"],
            neural_rounds=fr.get("neural", 0), fast_rounds=fr.get("ngram", 0) + fr.get("random", 0),
            sd_round=sd["decode_seconds"] / sd["rounds"] if sd else None,
            sd_verify=sd["verify_seconds"] / sd["rounds"] if sd else None,
            verify_s=r["verify_seconds"],
            E_sd=sd["tokens_per_round"] if sd else None,
            E_f=fast[0]["tokens_per_round_miss"] if fast else None))


# --------------------------------------------------------------------------------------------------
# The report: the hardware, the tables, the grid, the plot

def hardware():
    """The machine, for the hardware line and the JSON."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                 if x.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    dev = default_devices()
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "device": f"{dev[0]}/{dev[1]}{gpu}", "python": platform.python_version()}


def fmt(x, spec=".2f", none="-"):
    """A figure for a table, or `none` for a missing one."""
    return none if x is None else format(x, spec)


LEGEND = ("vs lcpp: tok/s / the llama.cpp peer's fastest row; accept: accepted / proposed "
          "draft tokens; a: the paper's per-token acceptance "
          "(capped-geometric MLE); hit: cache hit rate; wait%: verifier waiting for proposals / "
          "decode time; busy%: speculator busy / decode time (it includes the first round's "
          "pre-speculation, done during the prefill); B: mean budget (branches per sequence); "
          "stop%: rounds whose pre-speculation the outcome cut short; skip%: rounds that "
          "pre-speculated nothing (the gate measured it slower, or --pre-spec never); c_SD: SD's "
          "verification per round, c_v: ssd's, c: ssd's verifier per round, all in AR steps")


def print_tables(rows, a, n_prompts):
    print("\n" + LEGEND)
    groups = sorted({(r["temperature"], r["batch"]) for r in rows})
    for T, b in groups:
        g = [r for r in rows if r["temperature"] == T and r["batch"] == b]
        print(f"\ntemperature {T:g}, batch {b}, {n_prompts} {a.prompt_set} prompts, "
              f"max_new_tokens {a.max_new_tokens}, median of {a.repeats} runs")
        if b > 1 and "hf-assisted" in a.modes:
            print("(no hf-assisted row: transformers assisted generation supports batch 1 only)")
        w = max(len(r["label"]) for r in g)
        print(f"{'engine':<{w}}  {'tok/s/seq':>9} {'tok/s':>8} {'vs AR':>6} {'vs SD':>6} "
              f"{'vs lcpp':>7} {'tok/rnd':>7} {'accept':>6} {'hit':>5} {'wait%':>5} {'busy%':>5}")
        for r in g:
            print(f"{r['label']:<{w}}  {r['decode_tok_s_per_seq']:>9.1f} {r['decode_tok_s']:>8.1f} "
                  f"{fmt(r['speedup_vs_ar']):>6} {fmt(r['speedup_vs_sd']):>6} "
                  f"{fmt(r.get('speedup_vs_llama_cpp')):>7} "
                  f"{fmt(r.get('tokens_per_round')):>7} {fmt(r.get('accepted_per_proposed')):>6} "
                  f"{fmt(r.get('cache_hit_rate')):>5} {fmt(r.get('verifier_wait_pct'), '.0f'):>5} "
                  f"{fmt(r.get('draft_busy_pct'), '.0f'):>5}")
        for r in g:
            if r.get("same_tokens_as_ar", 1.0) < 1.0:
                print(f"{r['label']}: greedy tokens differ from AR's on "
                      f"{1 - r['same_tokens_as_ar']:.0%} of the prompts (not the same output)")
        th = [r for r in g if "theory" in r]
        if th:
            print(f"theory (Theorem 7{', Corollary 16' if b > 1 else ''}; times in AR steps; "
                  f"see bench_report.theory):")
            print(f"{'engine':<{w}}  {'a':>5} {'p_hit':>5} {'E_hit':>5} {'E_miss':>6} {'T_p':>5} "
                  f"{'T_b':>5} {'T_SD':>5} {'c_SD':>5} {'c_v':>5} {'c':>5} {'pred':>5} "
                  f"{'pred_c':>6} {'meas':>5} "
                  f"{'SD pred':>7} {'b*':>4} {'SSD/SD max':>10} {'B':>4} {'stop%':>5} "
                  f"{'skip%':>5}")
            for r in th:
                t = r["theory"]
                print(f"{r['label']:<{w}}  {r['acceptance_a']:>5.2f} {r['cache_hit_rate']:>5.2f} "
                      f"{r['tokens_per_round_hit']:>5.2f} {r['tokens_per_round_miss']:>6.2f} "
                      f"{t['T_p']:>5.2f} {t['T_b']:>5.2f} {fmt(t['T_SD']):>5} "
                      f"{fmt(t['c_SD']):>5} {fmt(t['c_v']):>5} {t['c']:>5.2f} "
                      f"{t['ssd_pred']:>5.2f} {t['ssd_pred_c']:>6.2f} "
                      f"{fmt(r['speedup_vs_ar']):>5} {fmt(t['sd_pred']):>7} "
                      f"{fmt(t['b_star'], 'd'):>4} {fmt(t['sd_bound']):>10} "
                      f"{r['mean_budget']:>4.1f} {r['stopped_pct']:>5.0f} "
                      f"{r['skipped_pct']:>5.0f}")
        print_depths([r for r in g if r["engine"] == "ssd"], w)


def print_depths(rows, w):
    """Per depth j = 0..K of each ssd row: the mean fan-out F_j used, and the hits over the
    lookups whose real accepted count was j."""
    if not rows:
        return
    print("per depth j = 0..K: mean F_j used; hits / lookups at n = j")
    for r in rows:
        F = " ".join(f"{f:.1f}" for f in r["row_fan_out_mean"])
        hits = " ".join(f"{h}/{n}" for h, n in zip(r["hits_per_depth"], r["lookups_per_depth"]))
        fixed = " (fixed B)" if r.get("fixed_budget") else ""
        print(f"{r['label']:<{w}}  F {F}{fixed}  hits {hits}")


def print_grid(rows):
    """SSD / SD in every (temperature, batch) cell, measured, with the theory's prediction
    (Corollary 16 with the measured c, over SD's measured speed-up) in brackets and, with more than
    one repeat, the lowest and highest SSD / SD of the passes (each against SD's run in the same
    pass) in square ones."""
    cells = {}
    for r in rows:
        if r["engine"] == "ssd" and r["speedup_vs_sd"]:
            sd = find(rows, "sd", r, r["threads"], r["k"])
            t = r.get("theory")
            pred = (t["ssd_pred_c"] / sd["speedup_vs_ar"]
                    if t and sd and sd["speedup_vs_ar"] else None)
            runs = r["speedup_vs_sd_runs"]
            spread = f" [{min(runs):.2f}-{max(runs):.2f}]" if len(runs) > 1 else ""
            cells.setdefault((r["temperature"], r["batch"]), []).append(
                f"{r['speedup_vs_sd']:.2f} ({fmt(pred)}){spread}")
    if not cells:
        return
    Ts, bs = sorted({T for T, _ in cells}), sorted({b for _, b in cells})
    print("\nSSD / SD, measured (theory with the measured c) [lowest-highest pass]:")
    print(f"{'':>6}" + "".join(f" {'batch ' + str(b):>24}" for b in bs))
    for T in Ts:
        line = f"{'T=' + format(T, 'g'):>6}"
        for b in bs:
            c = cells.get((T, b), [])
            line += " " + f"{', '.join(c) or '-':>24}"
        print(line)


def plot(rows, path):
    """Speed-up over AR vs temperature and vs batch size, and hit rate vs the fan-out budget B."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    b0 = min(r["batch"] for r in rows)
    T0 = min(r["temperature"] for r in rows)
    for label in sorted({r["label"] for r in rows if r["engine"] != "ar"}):
        mine = [r for r in rows if r["label"] == label and r["speedup_vs_ar"]]
        xs = sorted((r["temperature"], r["speedup_vs_ar"]) for r in mine if r["batch"] == b0)
        if xs:
            ax[0].plot(*zip(*xs), marker="o", label=label)
        xs = sorted((r["batch"], r["speedup_vs_ar"]) for r in mine if r["temperature"] == T0)
        if xs:
            ax[1].plot(*zip(*xs), marker="o", label=label)
    ssd = [r for r in rows if r["engine"] == "ssd" and r["batch"] == b0]
    for T in sorted({r["temperature"] for r in ssd}):
        for fan in sorted({r["fan_out"] for r in ssd}):
            pts = {}
            for r in ssd:
                if r["temperature"] == T and r["fan_out"] == fan:
                    pts.setdefault(r["budget"], []).append(r["cache_hit_rate"])
            xs = sorted((B, statistics.mean(v)) for B, v in pts.items())
            ax[2].plot(*zip(*xs), marker="o", label=f"T={T:g} {fan}")
    for x, (title, xl, yl) in zip(ax, [(f"batch {b0}", "temperature", "speed-up over AR"),
                                       (f"temperature {T0:g}", "batch size", "speed-up over AR"),
                                       (f"ssd, batch {b0}", "fan-out budget B", "cache hit rate")]):
        x.set_title(title), x.set_xlabel(xl), x.set_ylabel(yl)
        x.grid(alpha=0.3), x.legend(fontsize=7)
    ax[1].set_xscale("log", base=2)
    bs = sorted({r["batch"] for r in rows})
    ax[1].set_xticks(bs, [str(b) for b in bs])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
