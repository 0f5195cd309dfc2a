"""What the engine asks the speculation control (``SpeculationControl``) instead of reading its
members: whether steps run packed for its runner, and whether a request speculates now."""

from types import SimpleNamespace

from verifier_svc.request_speculation import RequestSpeculation
from verifier_svc.speculation import SpeculationConfig, SpeculationControl


def test_packed_steps_need_both_the_flag_and_a_runner_that_packs():
    control = SpeculationControl(SpeculationConfig())
    assert control.packed
    control.fit_runner(packs=True)
    assert control.packed
    control.fit_runner(packs=False)
    assert not control.packed
    padded = SpeculationControl(SpeculationConfig(packed_steps=False))
    padded.fit_runner(packs=True)
    assert not padded.packed


def test_a_request_speculates_while_it_has_a_proposer_stream():
    control = SpeculationControl(SpeculationConfig())
    session = SimpleNamespace(name="ngram", invalid_trees=0, close=lambda: None)
    seq = SimpleNamespace(speculation=RequestSpeculation.start(session))
    assert control.speculating(seq)
    control.abandon(seq.speculation)  # its stream closed: plain decoding from now on
    assert not control.speculating(seq)
    assert not control.speculating(SimpleNamespace(speculation=RequestSpeculation.start()))
