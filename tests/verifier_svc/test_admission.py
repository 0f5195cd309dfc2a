"""The KV memory budget: the admission rules on numbers, then the engine on the real model held to
a small budget (a long prompt runs beside short ones where its blocks fit, one that never fits is
refused, running requests grow into preemption and still decode exactly, every block comes back
after the requests end) and a failing step isolated to the requests it concerns."""

import threading
import time

import pytest
from support import assert_greedy_equal

from specmesh_server.model_runner import ModelRunner
from verifier_svc import admission
from verifier_svc.engine import Engine, EngineConfig
from verifier_svc.events import ErrorEvent, FinishEvent, NeverFits, TokenEvent
from verifier_svc.requests import GenerationRequest, SpecParams

NO_SPEC = SpecParams("none", 0, 0, "", "")
ROOM = EngineConfig.step_room


def test_a_waiting_request_joins_only_with_margin_to_grow_and_alone_if_it_fits_at_all():
    assert admission.admits(100, [10, 10], 50, margin=10)  # 50 + 20 + 3 × 10 = 100
    assert not admission.admits(100, [10, 10], 51, margin=10)
    assert admission.admits(100, [], 100, margin=10) and not admission.admits(100, [], 101, margin=10)


def test_prefill_chunks_shorten_with_depth_so_their_work_stays_bounded():
    keys = 3000.0
    work = [
        n * (keys + start + n / 2)
        for start in (0, 2000, 6000, 20000)
        for n in [admission.chunk_tokens(512, start, keys)]
    ]
    assert max(work) < 1.2 * work[0]  # each chunk costs about what a 512-token chunk at position 0 does
    assert admission.chunk_tokens(512, 10**7, keys) == 16  # never stalls: a least chunk


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.error: str | None = None
        self.finish: FinishEvent | None = None
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        if isinstance(ev, TokenEvent):
            self.tokens += ev.token_ids
            return
        if isinstance(ev, ErrorEvent):
            self.error = ev.message
        else:
            self.finish = ev
        self.done.set()


def _request(ids: list[int], max_tokens: int, **kw) -> GenerationRequest:
    args = dict(temperature=0.0, top_p=1.0, top_k=0, seed=1, stop=(), ignore_eos=False, spec_params=NO_SPEC) | kw
    return GenerationRequest("r", ids, max_tokens=max_tokens, **args)


def _settled(eng: Engine) -> None:
    """Every request released (the finish event is sent just before its blocks go back), and with it
    every block: free or cached, no reference left, whatever the requests' ends (finished, failed,
    preempted and recomputed, refused)."""
    deadline = time.monotonic() + 10
    while eng.in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.in_flight() == 0
    pool = eng.blocks.pool
    pool.check()
    assert all(r == 0 for r in pool.refs) and pool.free_blocks == pool.num_blocks


def _long_prompt(chat_ids, words: int) -> list[int]:
    text = " ".join(f"item{i % 97}" for i in range(words))
    return chat_ids(f"Here is a list: {text}. Say how many items it has.")


@pytest.mark.slow
def test_a_long_prompt_runs_beside_short_ones_where_its_blocks_fit_and_one_that_never_fits_is_refused(
    lm, chat_ids, hf_greedy, engine_factory
):
    """A dense cache would charge 4 rows × the long request's need (> the budget) and hold it back; in
    blocks the four fit together."""
    budget = 6000
    eng = engine_factory(kv_budget_tokens=budget)
    shorts = [chat_ids(p) for p in ("Name three colours.", "What is two plus two?", "Say hello in French.")]
    long_ids = _long_prompt(chat_ids, 400)
    assert 1000 < len(long_ids) < budget - ROOM - 8
    with pytest.raises(NeverFits, match=f"KV budget of {eng.cache.token_budget} positions"):
        eng.submit(_request(_long_prompt(chat_ids, 2400), 8), Collector())
    assert 4 * (len(long_ids) + ROOM + EngineConfig.kv_margin) > budget  # what the dense cache charged
    short_out = [Collector() for _ in shorts]
    for ids, c in zip(shorts, short_out, strict=True):
        eng.submit(_request(ids, 24, ignore_eos=True), c)
    long_out = Collector()
    eng.submit(_request(long_ids, 8), long_out)
    most = 0
    while not long_out.done.is_set():
        most = max(most, eng.counts()[0])
        time.sleep(0.002)
    assert most == 4  # the long request ran beside the three short ones
    for ids, c in zip(shorts, short_out, strict=True):
        assert c.done.wait(120) and c.error is None
        assert_greedy_equal(lm, ids, c.tokens, hf_greedy(ids, 24))
    assert long_out.done.wait(120) and long_out.error is None
    assert_greedy_equal(lm, long_ids, long_out.tokens, hf_greedy(long_ids, 8))
    assert eng.stats.preempted == 0
    assert eng.cache.allocated_bytes <= budget * eng.cache.bytes_per_token
    _settled(eng)


@pytest.mark.slow
def test_requests_that_outgrow_the_budget_are_preempted_and_recomputed_without_changing_their_output(
    lm, chat_ids, engine_factory
):
    prompts = [chat_ids("Count from one to a hundred in words."), chat_ids("Write the numbers 1 to 200.")]
    n, margin, longest = 160, 64, max(len(p) for p in prompts)
    # Both fit to start with (in 16-position blocks, one more for scratch); each grows to ~prompt + n
    # tokens, and two such rows exceed the budget.
    blocks = lambda positions: -(-positions // 16)  # noqa: E731
    budget = (2 * (blocks(longest + ROOM) + blocks(margin)) + 1) * 16
    assert blocks(longest + n + ROOM) * 16 <= budget - 16 < 2 * blocks(longest + n + ROOM) * 16
    eng, unbounded = engine_factory(kv_budget_tokens=budget, kv_margin=margin), engine_factory()
    outs, refs = [Collector(), Collector()], [Collector(), Collector()]
    for ids, c, ref in zip(prompts, outs, refs, strict=True):
        eng.submit(_request(ids, n, ignore_eos=True), c)
        unbounded.submit(_request(ids, n, ignore_eos=True), ref)
    for ids, c, ref in zip(prompts, outs, refs, strict=True):
        assert c.done.wait(300) and c.error is None and ref.done.wait(300)
        assert len(c.tokens) == n
        assert_greedy_equal(lm, ids, c.tokens, ref.tokens)
    assert eng.stats.preempted >= 1 and unbounded.stats.preempted == 0
    _settled(eng)


@pytest.mark.slow
def test_after_requests_end_every_block_is_free_or_cached_and_the_same_prompt_hits_its_prefix(
    lm, chat_ids, hf_greedy, engine_factory
):
    eng = engine_factory()
    ids = _long_prompt(chat_ids, 150)
    first, second = Collector(), Collector()
    eng.submit(_request(ids, 12, ignore_eos=True), first)
    assert first.done.wait(120) and first.error is None
    _settled(eng)
    pool = eng.blocks.pool
    pool.check()
    assert all(r == 0 for r in pool.refs) and pool.free_blocks == pool.num_blocks
    assert len(pool.cached) == (len(ids) + 12 - 1) // 16  # every full block of accepted tokens
    eng.submit(_request(ids, 12, ignore_eos=True), second)  # a whole-prompt hit: its last token is computed
    assert second.done.wait(120) and second.error is None
    assert second.tokens == first.tokens
    assert_greedy_equal(lm, ids, second.tokens, hf_greedy(ids, 12))
    assert pool.counters.hits == (len(ids) - 1) // 16 * 16
    _settled(eng)


@pytest.mark.slow
def test_prompts_that_share_a_prefix_ending_mid_block_or_at_a_block_boundary_decode_as_without_the_cache(
    lm, chat_ids, hf_greedy, engine_factory
):
    eng = engine_factory()
    base = _long_prompt(chat_ids, 40)
    first = Collector()
    eng.submit(_request(base, 4, ignore_eos=True), first)
    assert first.done.wait(120) and first.error is None
    for shared in (16 * 3 + 7, 16 * 4):  # ends mid-block; ends at a block boundary
        ids = base[:shared] + chat_ids("And now say something else entirely.")[5:]
        out = Collector()
        eng.submit(_request(ids, 12, ignore_eos=True), out)
        assert out.done.wait(120) and out.error is None
        assert out.finish.cached_tokens == shared // 16 * 16
        assert_greedy_equal(lm, ids, out.tokens, hf_greedy(ids, 12))
    _settled(eng)


@pytest.mark.slow
def test_a_cached_prefix_serves_only_its_own_cache_scope_and_its_requests_report_it(chat_ids, engine_factory):
    """The gateway puts each API key's tenant in front of the scope: one tenant's prompts never hit
    another's blocks (a hit would show in its time to first token)."""
    eng = engine_factory()
    ids = _long_prompt(chat_ids, 60)

    def run(scope: str) -> FinishEvent:
        out = Collector()
        eng.submit(_request(ids, 2, spec_params=SpecParams("none", 0, 0, "", "", scope)), out)
        assert out.done.wait(120) and out.error is None
        _settled(eng)
        return out.finish

    assert run("tenant-a/chat").cached_tokens == 0
    hits = eng.blocks.pool.counters.hits
    assert run("tenant-b/chat").cached_tokens == 0 and eng.blocks.pool.counters.hits == hits
    assert run("tenant-a/chat").cached_tokens == (len(ids) - 1) // 16 * 16 > 0


class FaultyRunner(ModelRunner):
    """Fails any forward whose input holds ``poison``: a fault tied to one request's tokens."""

    poison: int | None = None
    failures = 0

    def forward(self, rows, input_ids, *args, **kwargs):
        if self.poison is not None and bool((input_ids == self.poison).any()):
            FaultyRunner.failures += 1
            raise RuntimeError("injected fault")
        return super().forward(rows, input_ids, *args, **kwargs)


@pytest.mark.slow
def test_a_failing_step_fails_only_the_request_it_concerns(lm, chat_ids, hf_greedy, engine_factory):
    prompts = [chat_ids(p) for p in ("Why is the sky blue?", "Name the planets.", "Write a haiku about rain.")]
    refs = [hf_greedy(ids, 16) for ids in prompts]
    # A token the victim emits, which nobody else feeds before, poisons the victim's next decode step.
    victim = 2
    others = {t for i, (ids, ref) in enumerate(zip(prompts, refs, strict=True)) if i != victim for t in ids + ref}
    at = next(j for j in range(2, 16) if refs[victim][j] not in {*others, *prompts[victim], *refs[victim][:j]})
    poison = refs[victim][at]
    eng = engine_factory(runner_class=FaultyRunner)
    eng.runner.poison = poison
    FaultyRunner.failures = 0
    outs = [Collector() for _ in prompts]
    for ids, c in zip(prompts, outs, strict=True):
        eng.submit(_request(ids, 16, ignore_eos=True), c)
    for i, (ids, c) in enumerate(zip(prompts, outs, strict=True)):
        assert c.done.wait(120)
        if i == victim:
            assert c.error is not None and "decode step failed" in c.error
            assert c.tokens == refs[victim][: at + 1]
        else:
            assert c.error is None
            assert_greedy_equal(lm, ids, c.tokens, refs[i])
    assert FaultyRunner.failures == 2  # the batched step, then the victim's own retry
    # A prompt holding the poison fails its prefill alone; a request running beside it goes on.
    bystander, poisoned = Collector(), Collector()
    eng.submit(_request(prompts[0], 16, ignore_eos=True), bystander)
    while not bystander.tokens:  # running: the poisoned prompt gets a prefill forward of its own
        time.sleep(0.01)
    eng.submit(_request([*prompts[1], poison], 4), poisoned)
    assert poisoned.done.wait(60) and "prefill failed" in (poisoned.error or "")
    assert bystander.done.wait(120) and bystander.error is None
    assert len(bystander.tokens) == 16
    assert_greedy_equal(lm, prompts[0], bystander.tokens, refs[0])
    _settled(eng)


class RecordingRunner(ModelRunner):
    """Logs each forward: prefill (no ``write_pos``) or decode, its rows and its first position."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int, int, int]] = []  # (kind, rows, width, first position)

    def forward(self, rows, input_ids, positions, mask, write_pos=None, packing=None, **kw):
        kind = "prefill" if write_pos is None else "decode"
        self.calls.append((kind, input_ids.shape[0], input_ids.shape[1], int(positions[0, 0])))
        return super().forward(rows, input_ids, positions, mask, write_pos, packing, **kw)


@pytest.mark.slow
def test_a_long_prefill_interleaves_chunks_with_the_running_requests_decode_steps(chat_ids, engine_factory):
    eng = engine_factory(runner_class=RecordingRunner)
    runner = eng.runner
    short = [Collector(), Collector()]
    for c, p in zip(short, ("Count from one to fifty.", "Name ten animals."), strict=True):
        eng.submit(_request(chat_ids(p), 60, ignore_eos=True), c)
    while not all(c.tokens for c in short):
        time.sleep(0.01)
    long_ids = _long_prompt(chat_ids, 1000)
    start = len(runner.calls)
    long_out = Collector()
    eng.submit(_request(long_ids, 2), long_out)
    assert long_out.done.wait(180) and all(c.done.wait(120) for c in short)
    calls = runner.calls[start:]
    chunks = [(width, pos) for kind, rows, width, pos in calls if kind == "prefill"]
    hit = chunks[0][1]  # the chat template's first block, cached by the short requests
    assert hit % 16 == 0 and sum(w for w, _ in chunks) == len(long_ids) - hit and len(chunks) >= 5
    for width, pos in chunks[:-1]:  # each chunk is as long as its depth allows, no longer
        assert width == admission.chunk_tokens(512, pos, runner.keys_per_token)
    # The short requests outlive the prefill, and a decode step of theirs follows every chunk: their
    # next token never waits for more than one chunk (plus their own step).
    assert all(len(c.tokens) == 60 for c in short)
    kinds = "".join(kind[0] for kind, *_ in calls)  # "p" prefill, "d" decode
    assert "pp" not in kinds, kinds


@pytest.mark.slow
def test_a_short_prompt_behind_a_long_prefill_joins_its_forwards_whole_and_the_long_chunk_gives_way(
    lm, chat_ids, hf_greedy, engine_factory
):
    eng = engine_factory(runner_class=RecordingRunner)
    runner = eng.runner
    long_ids, short_ids = _long_prompt(chat_ids, 1000), chat_ids("Name ten animals.")
    long_out, short_out = Collector(), Collector()
    eng.submit(_request(long_ids, 2), long_out)
    while not any(kind == "prefill" for kind, *_ in runner.calls):
        time.sleep(0.005)
    eng.submit(_request(short_ids, 8, ignore_eos=True), short_out)
    assert short_out.done.wait(120) and short_out.error is None
    assert long_out.done.wait(180) and long_out.error is None
    prefills = [(rows, width, pos) for kind, rows, width, pos in runner.calls if kind == "prefill"]
    (joined,) = [i for i, (rows, _, _) in enumerate(prefills) if rows == 2]  # one forward, whole
    assert joined < len(prefills) - 1  # its first token came while the long prompt had chunks to go
    _, width, pos = prefills[joined]  # row 0: the long prompt's chunk, shortened by the short prompt
    full = admission.chunk_tokens(512, pos, runner.keys_per_token)
    assert admission.chunk_tokens(512 - len(short_ids), pos, runner.keys_per_token) <= width < full
    assert sum(w for rows, w, _ in prefills if rows == 1) + width == len(long_ids) - prefills[0][2]
    assert_greedy_equal(lm, short_ids, short_out.tokens, hf_greedy(short_ids, 8))
    assert_greedy_equal(lm, long_ids, long_out.tokens, hf_greedy(long_ids, 2))
    _settled(eng)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_a_verifier_held_to_a_small_kv_budget_refuses_what_never_fits_and_finishes_the_rest_within_memory(tmp_path, lm):
    import grpc
    from support import start_verifier, stop_verifier

    from specmesh.client import Client
    from specmesh.deploy import free_port
    from specmesh.params import SamplingParams

    budget_positions = 300 * 2**20 // 46080
    text = " ".join(f"item{i % 97}" for i in range(900))
    long_ids = lm.tokenizer(text)["input_ids"]
    assert 2500 < len(long_ids) < budget_positions // 2
    peak, stop = [0.0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mib(v.proc.pid))
            time.sleep(0.05)

    port = free_port()
    v = start_verifier(tmp_path, "--kv-cache-memory", "300MiB", "--max-running", "8", "--metrics-port", str(port))
    try:
        # Whole blocks, one of them scratch, within 300 MiB.
        budget_positions = (300 * 2**20 // (46080 * 16) - 1) * 16
        assert f"KV cache budget 300 MiB = {budget_positions} positions" in v.log()
        rss_start = _rss_mib(v.proc.pid)
        sampler = threading.Thread(target=sample)
        sampler.start()
        with Client(v.address) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.complete(long_ids * 3, SamplingParams(temperature=0.0, max_tokens=4))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"KV budget of {budget_positions} positions (--kv-cache-memory)" in err.value.details()

            def short(prompt: str):
                return c.complete(prompt, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), chat=True)

            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(4) as pool:
                shorts = [pool.submit(short, p) for p in ("Name three colours.", "Count to ten.", "Say hi.")]
                time.sleep(0.5)
                long = pool.submit(c.complete, long_ids, SamplingParams(temperature=0.0, max_tokens=4))
                assert all(len(f.result(timeout=300).token_ids) == 48 for f in shorts)
                assert long.result(timeout=300).summary.completion_tokens == 4
        stop.set()
        sampler.join()
        from urllib.request import urlopen

        metrics = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        kv = {
            line.split(" ")[0].split("{")[0]: float(line.rsplit(" ", 1)[1])  # one series each ({model=…})
            for line in metrics.splitlines()
            if line.startswith("specmesh_kv_cache")
        }
        assert kv["specmesh_kv_cache_budget_bytes"] == budget_positions * 46080
        assert kv["specmesh_kv_cache_bytes"] <= 300 * 2**20
        # The cache stays within its budget; the rest is a prefill chunk's activations.
        print(f"verifier RSS: start {rss_start:.0f} MiB, peak {peak[0]:.0f} MiB")
        assert peak[0] - rss_start < 300 + 250, (rss_start, peak[0])
    finally:
        stop.set()
        stop_verifier(v)


def test_a_request_that_could_not_fit_alone_is_refused_naming_its_need_and_the_budget():
    admission.check_fits(100, 50, 8192, step_room=ROOM, budget=150 + ROOM)
    with pytest.raises(NeverFits, match=f"needs up to {151 + ROOM} KV cache positions .* budget of {150 + ROOM}"):
        admission.check_fits(100, 51, 8192, step_room=ROOM, budget=150 + ROOM)
    admission.check_fits(100, 10**6, 200, step_room=ROOM, budget=200 + ROOM)  # the context caps max_tokens


def test_a_requests_need_is_its_cache_target_and_a_step_past_the_blocks_it_holds():
    from specmesh_server.kv_blocks import BlockManager, BlockPool
    from verifier_svc.sequence import Sequence

    blocks = BlockManager(BlockPool(64, block_size=16))
    seq = Sequence(key=0, req=_request(list(range(40)), 8), sink=print, detok=None, stopper=None, arrival=0.0)
    assert admission.need_blocks(blocks, seq, step_room=ROOM) == blocks.blocks_for(40 + ROOM)  # waiting: all of it
    seq.blocks = blocks.open(b"", list(range(40)))
    blocks.grow(seq.blocks, 64)
    assert admission.need_blocks(blocks, seq, step_room=ROOM) == blocks.blocks_for(40 + ROOM) - 4
    assert admission.need_blocks(blocks, seq, step_room=0) == 0  # holds more than it needs: nothing to add
