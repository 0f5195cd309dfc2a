"""``grammar.CompilePool``: structured outputs compiled several at once by the real xgrammar compiler for
the model's tokenizer, so a cheap schema never waits behind expensive ones; one compile per schema in
flight, however many requests send it; a compile past the time limit refuses its request naming the
field, and still lands in the cache."""

from __future__ import annotations

import asyncio
import json

import pytest

from verifier_svc.grammar import CompilePool, GrammarCompiler
from verifier_svc.requests import GrammarSpec, InvalidRequest

CHEAP = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}))


def expensive(i: int) -> GrammarSpec:
    """A schema of 60 patterned string fields, ~0.75 s to compile alone on this machine's cores; each ``i``
    its own patterns, so nothing of one is in the compiler's caches from another."""
    props = {
        f"f{i}_{k}": {"type": "string", "pattern": f"^[a-z]{{{k % 7 + 1},{k % 9 + 8}}}-{k}-{i}$"} for k in range(60)
    }
    return GrammarSpec("json_schema", json.dumps({"type": "object", "properties": props, "required": list(props)}))


@pytest.fixture(scope="module")
def compiler(lm) -> GrammarCompiler:
    return GrammarCompiler(lm.tokenizer, lm.model.config.vocab_size, {2})


def test_a_cheap_schema_compiles_while_eight_expensive_ones_still_do(lm):
    fresh = GrammarCompiler(lm.tokenizer, lm.model.config.vocab_size, {2})  # empty caches: nothing compiled yet
    pool = CompilePool(fresh, threads=9, timeout_s=60)
    done: list[str] = []

    async def one(name: str, spec: GrammarSpec) -> None:
        await pool.compile(spec)
        done.append(name)

    async def run() -> None:
        slow = [asyncio.create_task(one(f"expensive {i}", expensive(10 + i))) for i in range(8)]
        await asyncio.sleep(0.05)  # the expensive ones are compiling
        await one("cheap", CHEAP)
        assert done == ["cheap"], done  # it did not wait for any of them
        await asyncio.gather(*slow)

    asyncio.run(run())
    assert len(done) == 9


def test_one_compile_per_schema_in_flight_however_many_requests_send_it(compiler, monkeypatch):
    calls: list[GrammarSpec] = []
    real = compiler.compile
    monkeypatch.setattr(compiler, "compile", lambda spec: calls.append(spec) or real(spec))
    pool = CompilePool(compiler, threads=4, timeout_s=60)
    spec = expensive(100)

    async def run():
        return await asyncio.gather(*(pool.compile(spec) for _ in range(5)))

    results = asyncio.run(run())
    assert calls == [spec] and all(r is results[0] for r in results)


def test_a_compile_past_the_limit_is_refused_naming_the_field_and_lands_in_the_cache(compiler):
    pool = CompilePool(compiler, threads=2, timeout_s=0.01)
    spec = expensive(200)

    async def run():
        with pytest.raises(InvalidRequest) as exc:
            await pool.compile(spec)
        assert exc.value.field == spec.field and "--grammar-compile-timeout" in str(exc.value)
        while spec in pool._in_flight:  # the compile goes on without its request
            await asyncio.sleep(0.05)
        pool.timeout_s = 0.01
        return await pool.compile(spec)  # now from the cache, within the limit

    assert asyncio.run(run()) is not None
