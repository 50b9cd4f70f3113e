"""benchmarks/bucket_error.py: the error of QSGD's allreduce against its bucket size."""

import pytest

from benchmarks import bucket_error


def test_rows_trade_header_bytes_against_error():
  rows = bucket_error.run([4], [64, 256], [], size=1 << 14, keys=1)
  small, large = rows
  assert (small["bits"], small["bucket"], large["bucket"]) == (4, 64, 256)
  assert small["wire_bits"] == 5.0 and large["wire_bits"] == 4.25  # 8 header bytes per bucket
  for kind in ("normal", "t3"):  # a wider range per bucket: a coarser step
    assert 0 < small[kind] < large[kind] < 1
  table = bucket_error.markdown(rows)
  assert "| 4 | 256 | 4.250 |" in table and table.count("\n") == 3


def test_lm_gradients_are_the_matrices_of_two_batches():
  grads = bucket_error.lm_gradients([0])
  g = grads["lm@0"]
  assert g.shape == (2, 118_784) and g.dtype == "float32"
  assert (g[0] != g[1]).any()  # two batches


def test_cli_rejects_bad_buckets():
  with pytest.raises(SystemExit):
    bucket_error.main(["--buckets", "100", "--lm-steps"])
