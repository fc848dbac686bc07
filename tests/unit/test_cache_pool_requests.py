"""Malformed cache pool requests are refused with a message that names the field."""
import pytest
from prfaas.v1 import cache_pool_pb2 as pb

from services.cache_pool_client import convert

FULL = pb.KvCacheGroup(group_id=0, kind=pb.GROUP_KIND_FULL_ATTENTION)


@pytest.mark.parametrize("request_, message", [
    (pb.LookupRequest(block_size=4, groups=[FULL]), "model is empty"),
    (pb.LookupRequest(model="m", groups=[FULL]), "block_size must be positive"),
    (pb.LookupRequest(model="m", block_size=4), "groups is empty"),
    (pb.LookupRequest(model="m", block_size=4, groups=[pb.KvCacheGroup(group_id=1)]),
     "groups[0].kind: 0 is not allowed"),
    (pb.LookupRequest(model="m", block_size=4, groups=[FULL, FULL]), "a group_id is listed twice"),
    (pb.LookupRequest(model="m", block_size=4, groups=[FULL], block_hashes=[b"h", b""]), "block_hashes: empty hash"),
])
def test_bad_lookups(request_, message):
    with pytest.raises(ValueError) as error:
        convert.lookup_query_from_proto(request_)
    assert message in str(error.value)


def test_bad_puts_and_gets():
    with pytest.raises(ValueError, match="blocks is empty"):
        convert.check_put(pb.PutRequest(model="m"))
    with pytest.raises(ValueError, match=r"blocks\[1\].data is empty"):
        convert.blocks_from_proto([pb.CacheBlock(block_hash=b"a", data=b"x"), pb.CacheBlock(block_hash=b"b")])
    with pytest.raises(ValueError, match="must be empty with transfer_id"):
        convert.block_refs_from_proto(pb.GetRequest(model="m", transfer_id="t", blocks=[pb.CacheBlockRef()]))
    with pytest.raises(ValueError, match="blocks is empty"):
        convert.block_refs_from_proto(pb.GetRequest(model="m"))


def test_a_valid_lookup_round_trips():
    request = pb.LookupRequest(model="m", block_size=4, groups=[FULL], block_hashes=[b"a", b"b"])
    assert convert.lookup_query_to_proto(convert.lookup_query_from_proto(request)) == request
