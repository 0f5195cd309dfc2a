"""The slot KV cache: writes land at the requested positions; moves and growth keep contents."""

import torch

from specmesh_server.kv_cache import SlotKVCache


def _cache(**kw) -> SlotKVCache:
    return SlotKVCache(num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32, device=torch.device("cpu"), **kw)


def test_update_writes_ragged_positions_and_returns_views_up_to_kv_len():
    c = _cache(slot_capacity=4, seq_capacity=8)
    write_pos = torch.tensor([[2, 3], [0, 1]])  # row 0 continues at 2, row 1 starts at 0
    c.begin_forward(slice(1, 3), write_pos, kv_len=4)
    k = torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).view(2, 3, 2, 4)  # [b, heads, n, dim]
    keys, _ = c.update(k, -k, layer_idx=1)
    assert keys.shape == (2, 3, 4, 4)
    assert torch.equal(c.keys[1][1, :, 2:4], k[0]) and torch.equal(c.keys[1][2, :, 0:2], k[1])
    assert torch.equal(c.values[1][2, :, 0:2], -k[1])
    assert keys.data_ptr() == c.keys[1][1].data_ptr()  # a view, not a gather
    assert c.keys[0].abs().sum() == 0  # other layers untouched


def test_move_slot_and_growth_preserve_contents():
    c = _cache(slot_capacity=2, seq_capacity=4)
    c.keys[0][1, :, :3] = 7.0
    c.move_slot(1, 0, length=3)
    assert (c.keys[0][0, :, :3] == 7).all()
    c.reserve(slots=5, seq=9)
    assert c.slot_capacity >= 5 and c.seq_capacity >= 9
    assert (c.keys[0][0, :, :3] == 7).all() and (c.keys[0][0, :, 3:] == 0).all()


def test_gather_positions_compacts_accepted_entries():
    c = _cache(slot_capacity=1, seq_capacity=8)
    c.keys[0][0, 0, :, 0] = torch.arange(8, dtype=torch.float32)
    c.gather_positions(0, torch.tensor([3, 5, 6]), dst_start=3)
    assert c.keys[0][0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 6]


def test_seq_limit_caps_doubling_at_the_model_context():
    c = _cache(slot_capacity=1, seq_capacity=64, seq_limit=100)
    c.reserve(1, 90)
    assert c.seq_capacity == 100
