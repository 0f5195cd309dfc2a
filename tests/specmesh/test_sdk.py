"""The client SDK stands alone: importable without torch, typed params map onto the contract."""

import subprocess
import sys

from specmesh import SamplingParams, SpecDecodeParams
from specmesh.params import build_request


def test_sdk_and_cli_import_without_torch_or_transformers():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import specmesh, specmesh.cli, specmesh.deploy\n"
        "c = specmesh.Client('127.0.0.1:1'); c.close()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_unset_sampling_fields_stay_unset_on_the_wire():
    msg = SamplingParams(temperature=0.0, stop=("\n\n",)).to_proto()
    assert msg.HasField("temperature") and msg.temperature == 0.0
    assert not msg.HasField("top_p") and not msg.HasField("seed") and not msg.HasField("max_tokens")
    assert list(msg.stop) == ["\n\n"]


def test_prompt_kinds_map_to_the_input_oneof():
    spec = SpecDecodeParams(proposer="none", workload_tag="code")
    assert build_request("hi", None, spec, chat=False).WhichOneof("input") == "text"
    chat = build_request("hi", None, spec, chat=True)
    assert chat.WhichOneof("input") == "chat" and chat.chat.messages[0].role == "user"
    assert list(build_request([5, 6], None, None, chat=False).token_ids.ids) == [5, 6]
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert len(build_request(convo, None, None, chat=False).chat.messages) == 2
    assert chat.spec_decode.workload_tag == "code"
