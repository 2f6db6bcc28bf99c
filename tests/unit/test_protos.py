"""The generated gRPC code matches the protos, and the public contract has the agreed shape."""

import subprocess
import sys

from tests.conftest import ROOT


def test_generated_code_is_fresh():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_contract():
    from cosine.router.v1 import router_pb2

    service = router_pb2.DESCRIPTOR.services_by_name["Router"]
    assert service.full_name == "cosine.router.v1.Router"
    method = service.methods_by_name["Generate"]
    assert method.server_streaming and not method.client_streaming
    req = {f.name for f in router_pb2.GenerateRequest.DESCRIPTOR.fields}
    assert req == {"request_id", "prompt", "messages", "max_new_tokens", "sampling", "stop", "speculation"}
    assert router_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["prompt"].type == 12  # bytes
    sampling = router_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["sampling"].message_type
    assert {f.name for f in sampling.fields} == {"temperature", "top_p", "top_k", "seed"}
    spec = router_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["speculation"].message_type
    assert {f.name for f in spec.fields} == {"disabled", "drafters", "max_depth"}
    resp = router_pb2.GenerateResponse.DESCRIPTOR
    assert [o.name for o in resp.oneofs] == ["kind"]
    assert {f.name for f in resp.oneofs[0].fields} == {"chunk", "final"}
    final = resp.fields_by_name["final"].message_type
    assert {f.name for f in final.fields} == {"finish_reason", "usage", "stats"}
    assert {f.name for f in final.fields_by_name["stats"].message_type.fields} == {"rounds", "drafted_tokens", "accepted_tokens", "drafters"}


def test_enums_start_unspecified():
    from cosine.common.v1 import common_pb2

    for enum in common_pb2.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")
