"""The generated stubs in specmesh/v1 match the .proto contract."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_check_protos_passes_on_the_committed_stubs():
    out = subprocess.run(["make", "-s", "check-protos"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_contract_follows_buf_standard_naming():
    from specmesh.v1 import admin_pb2, generation_pb2, params_pb2, proposer_pb2, rag_pb2

    for mod in (admin_pb2, generation_pb2, params_pb2, proposer_pb2, rag_pb2):
        fd = mod.DESCRIPTOR
        assert fd.package == "specmesh.v1"
        for svc in fd.services_by_name.values():
            assert svc.name.endswith("Service")
            for m in svc.methods:
                assert m.input_type.name == f"{m.name}Request" and m.output_type.name == f"{m.name}Response"
        for enum in fd.enum_types_by_name.values():
            prefix = "".join(f"_{c}" if c.isupper() else c.upper() for c in enum.name).lstrip("_")
            assert enum.values[0].name == f"{prefix}_UNSPECIFIED" and enum.values[0].number == 0
            assert all(v.name.startswith(prefix + "_") for v in enum.values)
        for msg in fd.message_types_by_name.values():
            assert all(f.name == f.name.lower() for f in msg.fields)
