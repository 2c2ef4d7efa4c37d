"""n-gram speculative decoding on and off, side by side (issue 19, "Performance").

The default model (SmolLM2-135M-Instruct; float32 on the CPU), greedy, on chat
prompts whose answers repeat text the prompt already holds: copy a list, a
function with one variable renamed, a JSON object with one field changed, a
poem, a YAML file... That is the workload prompt lookup is made for: the
n-gram proposer (``engine/v1/spec_decode/ngram_proposer.py``) drafts the tokens
that followed the last few tokens where they occurred earlier, and the target
model verifies k drafts in one forward pass.

Modes (``--modes``; every mode builds its own ``LLM``):

  * ``off`` -- no speculation, the serial loop (``async_scheduling=False``):
    n-gram speculation turns async scheduling off (vLLM's rule), so this is
    the baseline that differs from the ngram modes only by speculation;
  * ``off_async`` -- no speculation, async scheduling (the engine's default;
    on the CPU it makes no difference, ``async_scheduling_cpu.json``);
  * ``ngram_k<K>`` -- ``{"method": "ngram", "num_speculative_tokens": K,
    "prompt_lookup_min": --prompt-lookup-min, "prompt_lookup_max":
    --prompt-lookup-max}``; ``ngram_k<K>_n<A>-<B>`` sets the lookup window to
    [A, B] for that mode.

Parts, each timed as one call after a short warm-up, with the prefix cache
emptied before it:

  * ``batch`` -- every prompt in one ``LLM.chat`` call;
  * ``batch1`` -- the same prompts (or the first ``--batch1-prompts``), one
    ``LLM.chat`` call at a time: speculation helps most at batch 1, where one
    request's decode step leaves most of the machine idle.

Figures per part: output tokens, wall seconds, output tokens/s; for the ngram
modes the ``glassbox:spec_decode_*`` counters of ``LLM.get_metrics()`` over the
timed call: drafts (request-steps that verified drafts), draft tokens, accepted
tokens, accepted per draft position. From them, as vLLM reports them: mean
acceptance length = 1 + accepted / drafts (tokens a request gains per
verification step), acceptance rate = accepted / draft tokens, and per position
i the fraction of drafts whose i-th token was accepted. Greedy outputs must not
change with speculation: every mode's token ids are compared with ``off``'s of
the same round and part, and every difference is listed (``mismatches``).

Rounds are interleaved (every round runs every mode) so that background load
hits all modes alike; the summary takes medians over rounds, and a mode's
speedup is the median over rounds of its tokens/s over ``off``'s of the same
round.

vLLM twins: ``examples/features/speculative_decoding/spec_decode_offline.py``
(read it for how the counters come out of ``LLM.get_metrics()`` and become an
acceptance length) and ``vllm/v1/spec_decode/metrics.py``
(``SpecDecodingLogging.log``: the three formulas above). Session 06.
Simpler than vLLM: its example reads one engine's totals after one run over a
dataset; here the counters are read before and after each timed call, the
same prompts run without speculation for the speed and the outputs to
compare, and the per-position counts are labelled counters (vLLM: one
``Vector`` metric).

Run:  .venv/bin/python benchmarks/spec_decode.py --device cpu --rounds 2 --out OUT/
      (about 5 minutes on a 2-vCPU machine with the defaults)
Writes ``OUT/spec_decode_<machine>.json`` (``_cpu``; ``_h200`` on the H200;
``_<model>`` added for ``--model``); ``--record`` stores it in
benchmarks/results (``results_store.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import results_store  # noqa: E402

# Chat prompts whose answers copy text from the prompt (and change a little of it).
PROMPTS: list[str] = [
    "Repeat this list exactly, one item per line: apples, bananas, cherries, dates, "
    "elderberries, figs, grapes, honeydew, kiwis, lemons, mangoes, nectarines.",
    "Here is a Python function:\n\ndef add_all(values):\n    x = 0\n    for v in values:\n"
    "        x = x + v\n    return x\n\nRename the variable x to total and print the whole "
    "function again.",
    'Copy this JSON and change the city to "Lyon":\n{"name": "Alice Martin", "age": 34, '
    '"city": "Paris", "email": "alice.martin@example.com", "languages": ["French", '
    '"English"], "active": true}',
    "Copy this sentence three times, each on its own line: The quick brown fox jumps over "
    "the lazy dog.",
    "Copy this CSV and change Bob's age to 41:\nname,age,city\nAlice,34,Paris\nBob,40,"
    "Berlin\nCarol,29,Madrid\nDave,52,Rome",
    "Repeat this poem line by line:\nRoses are red,\nViolets are blue,\nSugar is sweet,\n"
    "And so are you.",
    "Here is a SQL query:\nSELECT id, name, email FROM customers WHERE country = 'France' "
    "ORDER BY name;\nWrite the same query again, but for the table clients instead of "
    "customers.",
    "Copy this YAML config and set debug to true:\nserver:\n  host: 0.0.0.0\n  port: 8080\n"
    "  debug: false\ndatabase:\n  url: postgres://localhost/app\n  pool_size: 10",
    "Here is a JavaScript function:\n\nfunction greet(name) {\n  const message = 'Hello, ' + "
    "name + '!';\n  console.log(message);\n  return message;\n}\n\nRename greet to welcome and "
    "print the whole function again.",
    "Rewrite this HTML with the title changed to Home:\n<html>\n  <head>\n    <title>Welcome"
    "</title>\n  </head>\n  <body>\n    <h1>Hello</h1>\n    <p>This is my page.</p>\n  "
    "</body>\n</html>",
    "Repeat these steps exactly:\n1. Preheat the oven to 180 degrees.\n2. Mix the flour and "
    "the sugar.\n3. Add two eggs and the milk.\n4. Pour the batter into a pan.\n5. Bake for 30 "
    "minutes.",
    "Copy this Markdown table and add a row for Dave, 52, Rome:\n| name | age | city |\n"
    "| --- | --- | --- |\n| Alice | 34 | Paris |\n| Bob | 40 | Berlin |\n| Carol | 29 | Madrid |",
    "Repeat this address exactly:\nMarie Dupont\n12 Rue de la Paix\n75002 Paris\nFrance",
    "Here is a Python class:\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    "        self.y = y\n\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5"
    "\n\nRename the class Point to Vector and print the whole class again.",
    "Copy this shopping list and add milk at the end:\n- eggs\n- bread\n- butter\n- cheese\n"
    "- tomatoes\n- rice",
    "Repeat this email exactly:\nHi Sam,\nThanks for your message. The meeting is moved to "
    "Thursday at 10 am in room 4B. Please bring the quarterly report.\nBest regards,\nLee",
]
MAX_TOKENS = 128
WARMUP = (["Hello! Who are you?", "Name a color."], 8)  # prompts, tokens
DEFAULT_MODES = {"cpu": "off,ngram_k3,ngram_k5", "cuda": "off,off_async,ngram_k3,ngram_k5"}
PARTS = ("batch", "batch1")
MODE_RE = re.compile(r"ngram_k(\d+)(?:_n(\d+)-(\d+))?")


# --- modes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One engine set-up: speculation (None: off) and the loop it runs."""

    name: str
    speculative_config: dict[str, Any] | None
    async_scheduling: bool


def parse_mode(name: str, lookup_min: int, lookup_max: int) -> Mode:
    """``off``, ``off_async``, ``ngram_k<K>`` or ``ngram_k<K>_n<A>-<B>`` as a Mode."""
    if name == "off":
        return Mode(name, None, False)
    if name == "off_async":
        return Mode(name, None, True)
    m = MODE_RE.fullmatch(name)
    if not m:
        raise ValueError(f"unknown mode {name!r} (off, off_async, ngram_k<K>[_n<A>-<B>])")
    k = int(m.group(1))
    lo, hi = (int(m.group(2)), int(m.group(3))) if m.group(2) else (lookup_min, lookup_max)
    config = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": lo,
        "prompt_lookup_max": hi,
    }
    # n-gram runs the serial loop (the engine turns async scheduling off for it).
    return Mode(name, config, False)


# --- the spec-decode counters ----------------------------------------------------------


@dataclass(frozen=True)
class SpecCounters:
    """The ``glassbox:spec_decode_*`` counters (totals since the engine started, or
    the difference of two readings)."""

    num_drafts: int = 0  # request-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [k]: accepted at draft position i

    @classmethod
    def from_metrics(cls, metrics: Iterable[Any]) -> SpecCounters:
        """Read them from ``LLM.get_metrics()`` (all zero when speculation is off)."""
        values: dict[str, int] = {}
        per_pos: dict[int, int] = {}
        for metric in metrics:
            name = metric.name.removeprefix("glassbox:spec_decode_")
            if name == metric.name:
                continue
            if name == "num_accepted_tokens_per_pos":
                per_pos[int(metric.labels["position"])] = int(metric.value)
            else:
                values[name] = int(metric.value)
        return cls(
            num_drafts=values.get("num_drafts", 0),
            num_draft_tokens=values.get("num_draft_tokens", 0),
            num_accepted_tokens=values.get("num_accepted_tokens", 0),
            num_accepted_tokens_per_pos=tuple(per_pos[i] for i in sorted(per_pos)),
        )

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        before = earlier.num_accepted_tokens_per_pos or (0,) * len(self.num_accepted_tokens_per_pos)
        return SpecCounters(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            tuple(a - b for a, b in zip(self.num_accepted_tokens_per_pos, before)),
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        a, b = self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        n = max(len(a), len(b))
        a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
        return SpecCounters(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            tuple(x + y for x, y in zip(a, b)),
        )

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["num_accepted_tokens_per_pos"] = list(self.num_accepted_tokens_per_pos)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SpecCounters:
        return cls(
            d["num_drafts"],
            d["num_draft_tokens"],
            d["num_accepted_tokens"],
            tuple(d["num_accepted_tokens_per_pos"]),
        )


@dataclass(frozen=True)
class Acceptance:
    """What the counters say, as vLLM's spec-decode logger reports it."""

    mean_acceptance_length: float  # 1 + accepted / drafts: tokens per verification step
    acceptance_rate: float  # accepted / draft tokens
    per_position: tuple[float, ...]  # [k]: accepted at position i / drafts

    @classmethod
    def of(cls, c: SpecCounters) -> Acceptance | None:
        """None when nothing was drafted."""
        if not c.num_drafts or not c.num_draft_tokens:
            return None
        return cls(
            mean_acceptance_length=1.0 + c.num_accepted_tokens / c.num_drafts,
            acceptance_rate=c.num_accepted_tokens / c.num_draft_tokens,
            per_position=tuple(n / c.num_drafts for n in c.num_accepted_tokens_per_pos),
        )


# --- identical outputs --------------------------------------------------------------


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ (a length difference
    counts at the shorter one's end); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatches(
    baseline: list[list[int]], other: list[list[int]], *, round_index: int, mode: str, part: str
) -> list[dict[str, Any]]:
    """Every prompt whose tokens under ``mode`` differ from the baseline's."""
    out = []
    for prompt, (a, b) in enumerate(zip(baseline, other, strict=True)):
        at = first_difference(a, b)
        if at is not None:
            out.append(
                {
                    "round": round_index,
                    "mode": mode,
                    "part": part,
                    "prompt": prompt,
                    "first_difference_at": at,
                    "baseline_tokens": len(a),
                    "tokens": len(b),
                }
            )
    return out


# --- the summary ----------------------------------------------------------------------


def summarize(
    runs: dict[str, dict[str, list[dict[str, Any]]]], baseline: str = "off"
) -> dict[str, Any]:
    """Per mode and part: medians over rounds, the speedup against ``baseline``
    (median over rounds of the paired ratio), and the acceptance figures of the
    counters summed over rounds. Failed rounds (``error``) are left out."""
    summary: dict[str, Any] = {}
    for mode, parts in runs.items():
        s: dict[str, Any] = {}
        for part, rounds in parts.items():
            ok = [r for r in rounds if "error" not in r]
            if not ok:
                continue
            p: dict[str, Any] = {
                "rounds": len(ok),
                "output_tokens": ok[0]["output_tokens"],
                "seconds": statistics.median(r["seconds"] for r in ok),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
            }
            base = runs.get(baseline, {}).get(part, [])
            pairs = [
                r["tokens_per_s"] / b["tokens_per_s"]
                for r, b in zip(rounds, base)
                if "error" not in r and "error" not in b and b["tokens_per_s"]
            ]
            if pairs and mode != baseline:
                p["speedup"] = statistics.median(pairs)
            counters = [SpecCounters.from_json(r["spec"]) for r in ok if r.get("spec")]
            if counters:
                total = sum(counters[1:], counters[0])
                p["spec"] = total.to_json()
                acc = Acceptance.of(total)
                if acc is not None:
                    p["mean_acceptance_length"] = acc.mean_acceptance_length
                    p["acceptance_rate"] = acc.acceptance_rate
                    p["acceptance_per_position"] = list(acc.per_position)
            s[part] = p
        summary[mode] = s
    return summary


# --- running ----------------------------------------------------------------------------


def machine_info(device: str) -> dict[str, Any]:
    from benchmarks.cpu_vs_transformers import cpu_model

    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name()
    return info


def conversations(prompts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": p}] for p in prompts]


def run_mode(
    mode: Mode, args: argparse.Namespace, prompts: list[str], parts: list[str]
) -> dict[str, dict[str, Any]]:
    """Build one engine for ``mode`` and time each part; returns part -> figures
    (with the outputs' token ids under ``token_ids``, removed before saving)."""
    from engine import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(
        device=args.device, async_scheduling=mode.async_scheduling, disable_log_stats=False
    )
    if mode.speculative_config is not None:
        kwargs["speculative_config"] = mode.speculative_config
    if args.load_format != "auto":
        kwargs["load_format"] = args.load_format
    llm = LLM(args.model, **kwargs)
    out: dict[str, dict[str, Any]] = {}
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        warm_prompts, warm_tokens = WARMUP
        llm.chat(
            conversations(warm_prompts),
            SamplingParams(temperature=0, max_tokens=warm_tokens),
            use_tqdm=False,
        )
        for part in parts:
            llm.reset_prefix_cache()
            before = SpecCounters.from_metrics(llm.get_metrics())
            start = time.perf_counter()
            if part == "batch":
                outs = llm.chat(conversations(prompts), params, use_tqdm=False)
            else:
                outs = [
                    llm.chat(conversations([p]), params, use_tqdm=False)[0]
                    for p in prompts[: args.batch1_prompts]
                ]
            elapsed = time.perf_counter() - start
            spec = SpecCounters.from_metrics(llm.get_metrics()) - before
            token_ids = [list(o.outputs[0].token_ids) for o in outs]
            tokens = sum(len(t) for t in token_ids)
            figures: dict[str, Any] = {
                "output_tokens": tokens,
                "seconds": elapsed,
                "tokens_per_s": tokens / elapsed,
                "token_ids": token_ids,
            }
            if mode.speculative_config is not None:
                figures["spec"] = spec.to_json()
            if part == "batch":
                figures["texts"] = [o.outputs[0].text for o in outs]
            out[part] = figures
    finally:
        llm.shutdown()
    return out


def result_head(args: argparse.Namespace) -> dict[str, Any]:
    """What was measured, where, and at which commit."""
    import torch

    head: dict[str, Any] = {
        "benchmark": "spec_decode",
        "device": args.device,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": results_store.commit_id(),
        "torch": torch.__version__,
        "machine": machine_info(args.device),
        "model_arg": args.model or "default",
        "model": (
            f"{args.model}" + (", dummy weights" if args.load_format == "dummy" else "")
            if args.model
            else "SmolLM2-135M-Instruct (default model)"
            + (", float32" if args.device == "cpu" else "")
        ),
    }
    if args.device == "cuda":
        head["gpu"] = head["machine"]["gpu"]
    return head


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every mode (interleaved)")
    ap.add_argument("--modes", help="comma-separated (default: off,ngram_k3,ngram_k5 on the CPU)")
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: batch,batch1")
    ap.add_argument("--num-prompts", type=int, default=len(PROMPTS), help="the first N prompts")
    ap.add_argument("--batch1-prompts", type=int, help="batch1: the first N prompts (default: all)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--model", help="a model folder instead of the default model")
    ap.add_argument("--load-format", default="auto", help="auto, or dummy (random weights)")
    ap.add_argument("--out", default="out/", help="a directory (OUT/<series>.json) or a file")
    results_store.add_record_arguments(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not 1 <= args.num_prompts <= len(PROMPTS):
        ap.error(f"--num-prompts must be in 1..{len(PROMPTS)}, got {args.num_prompts}")
    args.batch1_prompts = min(args.batch1_prompts or args.num_prompts, args.num_prompts)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}")
    names = [m.strip() for m in (args.modes or DEFAULT_MODES[args.device]).split(",")]
    try:
        modes = [parse_mode(n, args.prompt_lookup_min, args.prompt_lookup_max) for n in names]
    except ValueError as e:
        ap.error(f"--modes: {e}")
    if modes[0].name != "off":
        ap.error("--modes must start with off (the baseline)")

    prompts = PROMPTS[: args.num_prompts]
    result: dict[str, Any] = {
        **result_head(args),
        "workload": {
            "prompts": prompts,
            "num_prompts": len(prompts),
            "batch1_prompts": args.batch1_prompts,
            "max_tokens": args.max_tokens,
            "sampling": "greedy (temperature 0); EOS stops a request",
            "load_format": args.load_format,
            "batch": "every prompt in one LLM.chat call",
            "batch1": f"the first {args.batch1_prompts} prompts, one LLM.chat call each",
        },
        "modes": {m.name: dataclasses.asdict(m) for m in modes},
        "rounds": args.rounds,
        "runs": {m.name: {part: [] for part in parts} for m in modes},
        "mismatches": [],
        "outputs_compared": 0,
    }
    out_path = results_store.output_path(args.out, result)
    started = time.time()

    def save() -> None:
        result["summary"] = summarize(result["runs"])
        result["identical_outputs"] = not result["mismatches"]
        result["elapsed_s"] = round(time.time() - started, 1)
        result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        out_path.write_text(results_store.dump_result(result))

    for round_index in range(args.rounds):
        baseline_ids: dict[str, list[list[int]]] = {}
        for mode in modes:
            try:
                figures = run_mode(mode, args, prompts, parts)
            except Exception:  # noqa: BLE001 -- keep the other modes' figures; say what failed
                figures = {p: {"error": traceback.format_exc(limit=8)} for p in parts}
            for part in parts:
                value = figures[part]
                ids = value.pop("token_ids", None)
                texts = value.pop("texts", None)
                if ids is not None:
                    if mode.name == "off":
                        baseline_ids[part] = ids
                    elif part in baseline_ids:
                        result["outputs_compared"] += len(ids)
                        result["mismatches"] += mismatches(
                            baseline_ids[part],
                            ids,
                            round_index=round_index,
                            mode=mode.name,
                            part=part,
                        )
                if texts is not None and round_index == 0 and mode.name == "off":
                    result["workload"]["outputs_off_round0"] = texts
                result["runs"][mode.name][part].append(value)
                print(
                    f"round {round_index} {mode.name:10s} {part:6s}: {json.dumps(value)[:300]}",
                    flush=True,
                )
            save()
    save()
    print(json.dumps(result["summary"], indent=1))
    n = len(result["mismatches"])
    print(
        f"greedy outputs: {result['outputs_compared']} compared with off, "
        + ("all identical" if not n else f"{n} DIFFER (see mismatches)")
    )
    print(f"wrote {out_path}")
    if args.record:
        stored = results_store.record(result, args.record, note=args.note)
        print(f"recorded {stored} (and its history line)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
