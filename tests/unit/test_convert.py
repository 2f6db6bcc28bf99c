"""The one conversion of sampling parameters and fusion modes between protos and domain objects."""

import pytest

from cosine.common.convert import (FUSION_MODE_PROTO, fusion_mode_name, sampling_from_dict, sampling_from_proto,
                                   sampling_to_dict, sampling_to_proto)
from cosine.common.v1 import common_pb2
from cosine.engine.sampling import Sampling
from cosine.scheduler.switches import FUSION_MODES


def test_every_domain_fusion_mode_has_its_proto_and_back():
    assert set(FUSION_MODE_PROTO) == set(FUSION_MODES)
    for name, value in FUSION_MODE_PROTO.items():
        assert fusion_mode_name(value) == name
    assert fusion_mode_name(common_pb2.FUSION_MODE_UNSPECIFIED, unspecified="merge") == "merge"
    with pytest.raises(ValueError):
        fusion_mode_name(common_pb2.FUSION_MODE_UNSPECIFIED)
    with pytest.raises(ValueError):
        fusion_mode_name(99)


def test_sampling_round_trips_through_the_proto_and_redis():
    s = Sampling(temperature=0.75, top_p=0.875, top_k=40, seed=12345)  # float32 in the proto: exact values
    assert sampling_from_proto(sampling_to_proto(s)) == s
    assert sampling_from_dict(sampling_to_dict(s)) == s


def test_unset_fields_take_their_defaults():
    assert sampling_from_proto(common_pb2.SamplingParams()) == Sampling(0.0, 1.0, 0, 0)
    assert sampling_from_proto(common_pb2.SamplingParams(temperature=1.0), default_seed=7).seed == 7
    assert sampling_from_proto(common_pb2.SamplingParams(seed=0), default_seed=7).seed == 0  # an explicit 0 is a seed
    assert sampling_from_dict({"temperature": 0.5, "seed": 3}) == Sampling(0.5, 1.0, 0, 3)
