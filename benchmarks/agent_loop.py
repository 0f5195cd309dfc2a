"""The agent loop benchmark: scripted coding agents driving the gateway's Responses API turn after turn
over a growing context (read a file, edit it, read it again, run the tests, summarise; then the next file),
each turn a streamed ``responses.create`` with every earlier item re-sent, as agent SDKs do. Where
speculation and prefix caching should pay most: tool-call JSON and repeated file contents to draft,
a long shared prefix to reuse.

    .venv/bin/python benchmarks/agent_loop.py --agents 1,8 --out docs/bench/issue58-agents

Deterministic: each turn's tool is forced by ``tool_choice`` (its arguments the model's, held to the
tool's schema by the grammar), greedy decoding, so every mode sees the same contexts and answers, and
the turns pair up across modes. Modes: plain (``proposer: none``), ngram, suffix, auto; each mode runs
under its own ``cache_salt`` and ``cache_scope``, so no mode reuses another's cached prompts or learned
outputs. Per turn: seconds, time to first token, output tokens, cached prompt tokens; at 1 agent the
plain run re-sends each turn from the third on under a fresh salt: the cold prefill of the same context.
Every tool call is checked against its schema, and every mode's outputs against plain's.
Writes summary.md and summary.json (and records.jsonl, not committed) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository the agents work on: real source files of this project (their first lines).
FILES = {
    "params.py": ("specmesh/params.py", 1800),
    "errors.py": ("gateway_svc/errors.py", 1800),
    "estimate.py": ("router/estimate.py", 1800),
}
TEST_LOG = "\n".join(
    ["============================= test session starts ==============================",
     "collected 42 items", "",
     "tests/test_params.py ..........                                           [ 23%]",
     "tests/test_errors.py ...........                                          [ 50%]",
     "tests/test_estimate.py .....................                              [100%]", "",
     "============================== 42 passed in 1.21s =============================="]
)  # fmt: skip
MODES = {"plain": "none", "ngram": "ngram", "suffix": "suffix", "auto": "auto"}


def tools() -> list[dict]:
    path = {"type": "string", "enum": sorted(FILES)}
    text = {"type": "string", "maxLength": 40}
    obj = lambda props: {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}  # noqa: E731
    return [
        {"type": "function", "name": "read_file", "description": "Read a file of the repository.",
         "parameters": obj({"path": path})},
        {"type": "function", "name": "edit_file", "description": "Replace the text old by new in a file.",
         "parameters": obj({"path": path, "old": text, "new": text})},
        {"type": "function", "name": "run_tests", "description": "Run the test suite.", "parameters": obj({})},
    ]  # fmt: skip


def script(agent: int) -> list[tuple[str, str | None]]:
    """(user message or "", tool forced or None for a free answer) per turn; each agent its own file order."""
    names = sorted(FILES)
    order = names[agent % len(names) :] + names[: agent % len(names)]
    turns: list[tuple[str, str | None]] = []
    for k, name in enumerate(order[:2]):
        ask = f"Fix the typo in {name}, then run the tests." if k == 0 else f"Now do the same for {name}."
        turns += [(ask, "read_file"), ("", "edit_file"), ("", "read_file"), ("", "run_tests"),
                  ("Summarise what you changed and the test result in two sentences.", None)]  # fmt: skip
    return turns


class Workspace:
    """The files an agent edits, and its tools' answers."""

    def __init__(self) -> None:
        self.files = {name: (ROOT / path).read_text()[:size] for name, (path, size) in FILES.items()}

    def call(self, name: str, args: dict) -> str:
        if name == "read_file":
            return self.files[args["path"]]
        if name == "edit_file":
            text = self.files[args["path"]]
            if args["old"] and args["old"] in text:
                self.files[args["path"]] = text.replace(args["old"], args["new"], 1)
                return f"Edited {args['path']}."
            return f"No match for {args['old']!r} in {args['path']}: nothing changed."
        return TEST_LOG


def run_agent(client, model: str, agent: int, mode: str, run: str, cold: bool, max_tokens: int) -> list[dict]:
    """One agent's turns in ``mode``; ``cold``: each turn from the third re-sent under a fresh salt."""
    import jsonschema

    schemas = {t["name"]: t["parameters"] for t in tools()}
    ws, items, out = Workspace(), [], []
    spec = {"proposer": MODES[mode], "cache_scope": f"agents-{mode}-{run}", "cache_salt": f"{mode}-{run}"}
    instructions = "You are a coding agent. Use the tools to read, edit and test the repository."
    for turn, (ask, tool) in enumerate(script(agent)):
        if ask:
            items.append({"role": "user", "content": ask})
        kw = {"model": model, "instructions": instructions, "input": list(items), "tools": tools(),
              "tool_choice": {"type": "function", "name": tool} if tool else "none",
              "max_output_tokens": max_tokens, "temperature": 0}  # fmt: skip
        record = {"agent": agent, "turn": turn, "mode": mode, "tool": tool or "", **_timed(client, kw, spec)}
        if cold and turn >= 2:
            fresh = {**spec, "cache_salt": f"cold-{uuid.uuid4().hex}"}
            record["cold_ttft_s"] = _timed(client, kw, fresh)["ttft_s"]
        response = record.pop("response")
        calls = [o for o in response.output if o.type == "function_call"]
        record["valid"] = True
        for call in calls:
            try:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            except Exception:
                record["valid"] = False
        record["answer"] = json.dumps([c.arguments for c in calls]) if calls else response.output_text
        out.append(record)
        for call in calls:
            items.append(
                {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
            )
            result = ws.call(call.name, json.loads(call.arguments)) if record["valid"] else "invalid arguments"
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
        if not calls:
            items.append({"role": "assistant", "content": response.output_text})
    return out


def _timed(client, kw: dict, spec: dict) -> dict:
    """A streamed request: seconds, time to its first output delta, token counts, the final response."""
    t0 = time.perf_counter()
    ttft = None
    response = None
    with client.responses.stream(**kw, extra_body={"spec_decode": spec}) as stream:
        for ev in stream:
            if ttft is None and ev.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
                ttft = time.perf_counter() - t0
            if ev.type in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
                response = ev.response
    if response is None:
        raise RuntimeError(f"the stream ended without a final response ({kw['tool_choice']})")
    u = response.usage
    return {
        "seconds": time.perf_counter() - t0,
        "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
        "output_tokens": u.output_tokens,
        "input_tokens": u.input_tokens,
        "cached_tokens": u.input_tokens_details.cached_tokens,
        "response": response,
    }


def run_mode(base_url: str, model: str, mode: str, agents: int, max_tokens: int) -> list[dict]:
    import openai

    run = uuid.uuid4().hex[:8]
    results: list[list[dict]] = [[] for _ in range(agents)]

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=900)
        results[i] = run_agent(client, model, i, mode, run, cold=agents == 1 and mode == "plain", max_tokens=max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [{**r, "agents": agents} for rs in results for r in rs]


def _after_first(record: dict) -> float:
    return record["seconds"] - record["ttft_s"]


def summarize(records: list[dict], agents_list: list[int], modes: list[str]) -> tuple[str, dict]:
    from specmesh_bench.report import bootstrap_interval

    lines, summary = [], {}
    for agents in agents_list:
        rs = [r for r in records if r["agents"] == agents]
        plain = {(r["agent"], r["turn"]): r for r in rs if r["mode"] == "plain"}
        lines += [f"\n### {agents} concurrent agent{'s' if agents > 1 else ''}\n",
                  "| mode | turns | output tok/s per agent | end-to-end vs plain (paired per turn, 95 % interval) | "
                  "agent wall time vs plain | after the first token vs plain | median TTFT | "
                  "time before the first token | cached share of prompts | tool calls valid | same answers as plain |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for mode in modes:
            mine = [r for r in rs if r["mode"] == mode]
            if not mine:
                continue
            tok_s = sum(r["output_tokens"] for r in mine) / sum(r["seconds"] for r in mine)
            ratios = [plain[(r["agent"], r["turn"])]["seconds"] / r["seconds"] for r in mine]
            iv = bootstrap_interval([ratios])
            walls = [
                sum(p["seconds"] for k, p in plain.items() if k[0] == a)
                / sum(r["seconds"] for r in mine if r["agent"] == a)
                for a in sorted({r["agent"] for r in mine})
            ]
            same = sum(r["answer"] == plain[(r["agent"], r["turn"])]["answer"] for r in mine)
            cached = sum(r["cached_tokens"] for r in mine) / max(sum(r["input_tokens"] for r in mine), 1)
            med_ratio = statistics.median(ratios)
            # the turns' time after their first token (what a proposer can shorten), summed, plain's over this mode's
            after = sum(_after_first(plain[(r["agent"], r["turn"])]) for r in mine) / sum(map(_after_first, mine))
            before = sum(r["ttft_s"] for r in mine) / sum(r["seconds"] for r in mine)
            lines.append(
                f"| {mode} | {len(mine)} | {tok_s:.1f} | {med_ratio:.2f}x ({iv.low:.2f}–{iv.high:.2f}) | "
                f"{statistics.median(walls):.2f}x | {after:.2f}x | "
                f"{statistics.median(r['ttft_s'] for r in mine) * 1e3:.0f} ms | {before:.0%} | "
                f"{cached:.0%} | {sum(r['valid'] for r in mine)}/{len(mine)} | {same}/{len(mine)} |"
            )
            summary[f"{agents}/{mode}"] = {
                "tokens_per_s": tok_s, "ratio_median": med_ratio, "interval": [iv.low, iv.high],
                "wall_ratio": statistics.median(walls), "after_first_ratio": after, "before_first_share": before,
                "cached_share": cached, "same": same, "turns": len(mine),
            }  # fmt: skip
        if (share := summary.get(f"{agents}/plain", {}).get("before_first_share")) is not None:
            lines.append(
                f"\nPlain spends {share:.0%} of its turn time before the first token (prefill of each turn's new "
                f"input, and the first token), which no proposer shortens: were every later token free, a mode "
                f"would be {1 / share:.2f}x plain end to end over these turns."
            )
            summary[f"{agents}/end_to_end_bound"] = 1 / share
        colds = [r for r in rs if r["mode"] == "plain" and "cold_ttft_s" in r]
        if colds:
            lines += ["\nPlain, TTFT per turn with the earlier turns' prefix cached vs the same context cold "
                      "(a fresh salt):\n", "| turn | prompt tokens | cached | TTFT warm | TTFT cold | cold / warm |",
                      "|---|---|---|---|---|---|"]  # fmt: skip
            for r in colds:
                lines.append(
                    f"| {r['turn']} | {r['input_tokens']} | {r['cached_tokens']} | {r['ttft_s'] * 1e3:.0f} ms | "
                    f"{r['cold_ttft_s'] * 1e3:.0f} ms | {r['cold_ttft_s'] / r['ttft_s']:.1f}x |"
                )
            summary[f"{agents}/ttft_cold_over_warm"] = statistics.median(r["cold_ttft_s"] / r["ttft_s"] for r in colds)
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="1,8", help="concurrent agents per run, comma-separated (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_output_tokens per turn (default: %(default)s)")
    ap.add_argument("--target", default="", help="a running gateway's /v1 URL; default: start a local deployment")
    ap.add_argument("--out", type=Path, default=Path("bench-results/agents"))
    ap.add_argument(
        "--verifier-arg",
        action="append",
        default=[],
        help="extra flag for the local verifier, e.g. --verifier-arg=--weights=gguf (repeatable)",
    )
    a = ap.parse_args(argv)
    agents_list = [int(x) for x in a.agents.split(",")]
    modes = a.modes.split(",")
    import contextlib
    import subprocess

    with contextlib.ExitStack() as stack:
        base = a.target
        if not base:
            from specmesh.deploy import DeploymentConfig, LocalDeployment, free_port

            run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specmesh-agents-")))
            cfg = DeploymentConfig(
                verifier_address=f"127.0.0.1:{free_port()}", ngram_address=f"127.0.0.1:{free_port()}",
                suffix_address=f"127.0.0.1:{free_port()}", gateway_address=f"127.0.0.1:{free_port()}",
                run_dir=run_dir, max_running=16, extra_verifier_args=tuple(a.verifier_arg),
            )  # fmt: skip
            dep = stack.enter_context(LocalDeployment(cfg))
            base = dep.gateway_url
        import openai

        model = openai.OpenAI(base_url=base, api_key="unused").models.list().data[0].id
        records: list[dict] = []
        t0 = time.perf_counter()
        for agents in agents_list:
            for mode in modes:
                print(f"agents: {agents} agent(s), {mode} …", file=sys.stderr, flush=True)
                records += run_mode(base, model, mode, agents, a.max_tokens)
        table, summary = summarize(records, agents_list, modes)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    head = (f"# Agent loop benchmark\n\n`{' '.join(['benchmarks/agent_loop.py', *(argv or sys.argv[1:])])}` at "
            f"{commit.strip()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {len(records)} turns in "
            f"{time.perf_counter() - t0:.0f} s; model {model}.\n")  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.md").write_text(head + table + "\n")
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (a.out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print(head + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
