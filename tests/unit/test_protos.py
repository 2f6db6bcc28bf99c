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
    assert {f.name for f in spec.fields} == {"disabled", "drafters", "max_depth", "fusion", "routing", "adaptive_depth",
                                               "pipelining"}
    numbers = {f.name: f.number for f in spec.fields}
    assert numbers == {"disabled": 1, "drafters": 2, "max_depth": 3, "fusion": 4, "routing": 5, "adaptive_depth": 6, "pipelining": 7}
    assert [v.name for v in spec.fields_by_name["fusion"].enum_type.values] == [
        "FUSION_MODE_UNSPECIFIED", "FUSION_MODE_CONFIDENCE", "FUSION_MODE_MERGE", "FUSION_MODE_SINGLE"]
    assert all(spec.fields_by_name[n].has_presence for n in ("routing", "adaptive_depth", "pipelining"))
    resp = router_pb2.GenerateResponse.DESCRIPTOR
    assert [o.name for o in resp.oneofs] == ["kind"]
    assert {f.name for f in resp.oneofs[0].fields} == {"chunk", "final"}
    final = resp.fields_by_name["final"].message_type
    assert {f.name for f in final.fields} == {"finish_reason", "usage", "stats"}
    stats = final.fields_by_name["stats"].message_type
    assert {f.name: f.number for f in stats.fields} == {"rounds": 1, "drafted_tokens": 2, "accepted_tokens": 3, "drafters": 4,
                                                         "lookup_drafted_tokens": 5, "lookup_accepted_tokens": 6}


def test_enums_start_unspecified():
    from cosine.common.v1 import common_pb2

    for enum in common_pb2.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")


def test_internal_messages_keep_their_field_numbers():
    """Fields only ever get added with new numbers: a rolling upgrade mixes old and new services."""
    from cosine.drafter.v1 import drafter_pb2
    from cosine.fusion.v1 import fusion_pb2
    from cosine.scheduler.v1 import scheduler_pb2

    def numbers(message):
        return {f.name: f.number for f in message.DESCRIPTOR.fields}

    assert numbers(drafter_pb2.DraftStep) == {"committed_token_ids": 1, "depth": 2, "trace_context": 3, "context_token_ids": 4, "top_k": 5}
    assert numbers(drafter_pb2.DraftOpen) == {"request_id": 1, "prompt_token_ids": 2, "score_prompt": 3}
    assert numbers(drafter_pb2.DraftResponse) == {"token_ids": 1, "probs": 2, "candidates": 3, "prompt_fit": 4}
    assert numbers(drafter_pb2.Candidates) == {"token_ids": 1, "probs": 2}
    assert numbers(fusion_pb2.SpeculateOpen) == {"request_id": 1, "prompt_token_ids": 2, "drafters": 3, "fusion": 4,
                                                 "score_prompt": 5}
    assert numbers(fusion_pb2.SpeculateRound) == {"committed_token_ids": 1, "depth": 2, "trace_context": 3, "drafters": 4, "budget": 5,
                                                     "context_token_ids": 6}
    assert numbers(fusion_pb2.SpeculateResponse) == {"tree": 1, "draft_ms": 2, "proposals": 3, "fused_token_ids": 4,
                                                     "prompt_fits": 5}
    from cosine.common.v1 import common_pb2

    assert numbers(common_pb2.PromptFit) == {"drafter": 1, "positions": 2, "hits": 3, "confidence_sum": 4, "logprob_sum": 5,
                                             "has_logprob": 6}
    assert numbers(fusion_pb2.DrafterProposal) == {"drafter": 1, "token_ids": 2, "probs": 3}
    assert numbers(scheduler_pb2.SubmitRequest) == {
        "request_id": 1, "prompt_token_ids": 2, "max_new_tokens": 3, "sampling": 4, "speculation": 5, "stop_token_ids": 6,
        "candidate_drafters": 7, "resume": 8, "resume_from": 9}
    assert numbers(scheduler_pb2.CommittedTokens) == {"token_ids": 1, "drafted_tokens": 2, "accepted_tokens": 3, "start_index": 4}
    assert numbers(scheduler_pb2.SubmitResponse) == {"request_id": 1, "tokens": 2, "final": 3, "handover": 4}
