"""The --shard option (tests/conftest.py) that scripts/gpu_suite.sh uses to run a group in parallel processes."""
import pytest

from conftest import shard_slice


@pytest.mark.parametrize("num_items", [0, 1, 5, 97])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_shards_cover_every_test_once_in_order(num_items, n):
    slices = [shard_slice(num_items, f"{i}/{n}") for i in range(1, n + 1)]
    covered = [k for start, stop in slices for k in range(start, stop)]
    assert covered == list(range(num_items))
    sizes = [stop - start for start, stop in slices]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b", "1/0"])
def test_bad_shard_is_a_usage_error(bad):
    with pytest.raises(pytest.UsageError, match="--shard"):
        shard_slice(10, bad)
