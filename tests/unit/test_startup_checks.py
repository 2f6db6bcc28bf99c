"""The scheduler refuses to start when a drafter's tokenizer differs from the target's.

The verifier and fusion are stand-in objects answering Info/ListDrafters: the logic
under test is the comparison, not the transport (the integration tests start the
real services, whose tokenizers match).
"""

import pytest

from cosine.common.v1 import common_pb2
from cosine.fusion.v1 import fusion_pb2
from cosine.scheduler.__main__ import TokenizerMismatch, check_models


class Stub:
    def __init__(self, target, drafters):
        self.target, self.drafters = target, drafters

    async def Info(self, request, **kwargs):
        return self.target

    async def ListDrafters(self, request, **kwargs):
        return fusion_pb2.DrafterList(drafters=self.drafters)


TARGET = common_pb2.ModelInfo(name="t", vocab_size=100, tokenizer_hash="abc", max_context=512)


async def test_matching_and_tokenizer_free_drafters_pass():
    drafters = [common_pb2.ModelInfo(name="lm", vocab_size=100, tokenizer_hash="abc"), common_pb2.ModelInfo(name="ngram")]
    stub = Stub(TARGET, drafters)
    target, found = await check_models(stub, stub, timeout=1)
    assert target.max_context == 512 and [d.name for d in found] == ["lm", "ngram"]


@pytest.mark.parametrize("drafter", [common_pb2.ModelInfo(name="lm", vocab_size=99, tokenizer_hash="abc"),
                                     common_pb2.ModelInfo(name="lm", vocab_size=100, tokenizer_hash="xyz")])
async def test_a_different_tokenizer_is_refused(drafter):
    stub = Stub(TARGET, [drafter])
    with pytest.raises(TokenizerMismatch, match="lm"):
        await check_models(stub, stub, timeout=1)
