"""``specmesh rag ingest``'s upload stream: the bar counts every byte and changes no message."""

from __future__ import annotations

from pathlib import Path

import tqdm

from proposer_svc.rag import cli as rag_cli
from proposer_svc.rag.cli import _with_upload_bar, ingest_requests


def _requests(tmp_path: Path) -> list:
    doc = tmp_path / "a.txt"
    doc.write_text("x" * 2500)
    return list(ingest_requests("c", [doc], ["hello"], replace=False, chunk_bytes=1000))


def test_upload_bar_passes_every_message_through_and_counts_all_bytes(tmp_path, monkeypatch, capsys):
    counted = []

    class Recording(tqdm.tqdm):
        def close(self) -> None:
            counted.append((self.n, self.total))
            super().close()

    monkeypatch.setattr(rag_cli, "tqdm", Recording)
    sent = list(_with_upload_bar(iter(_requests(tmp_path)), total_bytes=2505))
    assert sent == _requests(tmp_path)
    assert set(counted) == {(2505, 2505)}  # (tqdm may close twice)
    assert "upload" in capsys.readouterr().err  # on stderr; stdout stays the command's result
