"""Issue 20: on a GPU the engine's greedy rows take their token from a Triton argmax
(`nanoserve/kernels/argmax.py`): the same index as `torch.argmax`, ties included (the first of
equal maxima). Issue 39 does it in one launch (the last program of a row picks among the slices);
the two-kernel form stays behind `one_pass=False` and NANOSERVE_FUSE_OFF=argmax, and both are
checked here. On the CPU the kernels run in Triton's interpreter."""

import pytest
import torch

pytest.importorskip("triton", reason="the argmax is a Triton kernel: pip install triton (Linux)")

from nanoserve.kernels import fusion  # noqa: E402
from nanoserve.kernels.argmax import LOWEST_KEY, argmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def every_fusion_on():
    """Every fusion on for the tests here (the one-launch argmax is off by default: nanoserve/kernels/fusion.py says why)."""
    fusion.switch_fusions("")
    yield
    fusion.switch_fusions(None)
FORMS = pytest.mark.parametrize("one_pass", [True, False], ids=["one-launch", "two-kernels"])


@FORMS
@pytest.mark.parametrize("rows,vocab,block", [(1, 128256, 4096), (3, 5000, 1024), (5, 49152, 4096), (2, 1000, 256)])
def test_same_index_as_torch(rows, vocab, block, one_pass):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(DEVICE)
    assert torch.equal(argmax(logits, block, one_pass=one_pass), logits.argmax(dim=-1))


@pytest.mark.exercise("argmax-one-launch")
@FORMS
def test_ties_and_infinities(one_pass):
    logits = torch.zeros(7, 1000)
    logits[0, [700, 65]] = 3.0  # two maxima in different slices
    logits[1, [130, 100]] = 2.0  # two in one slice
    logits[2, [999, 0]] = 1.0  # the last column and the first
    logits[4] = float("-inf")  # every token masked but one (a grammar's mask)
    logits[4, 999] = -1.0
    logits[5] = -5.0  # all negative: the float bits order backwards there
    logits[5, [400, 300]] = -0.5
    logits[6] = float("-inf")  # -0.0 in an early slice ties with +0.0 in a later one
    logits[6, 900], logits[6, 10] = 0.0, -0.0
    logits = logits.to(DEVICE)
    expected = [65, 100, 0, 0, 999, 300, 10]
    assert argmax(logits, 256, one_pass=one_pass).tolist() == logits.argmax(dim=-1).tolist() == expected


@pytest.mark.exercise("argmax-one-launch")
def test_one_pass_leaves_its_counters_ready():
    """The last program of each row resets the row's key and counter: calls in a row (as graph
    replays would) with rows of other maxima each get their own answer, never an earlier one's."""
    g = torch.Generator().manual_seed(7)
    for rows in (3, 1, 4):
        logits = torch.randn(rows, 3000, generator=g).to(DEVICE) - 10 * rows  # each call's maxima lower
        assert torch.equal(argmax(logits, 512), logits.argmax(dim=-1))
    keys = fusion.persistent_buffer("argmax keys", torch.device(DEVICE), 4, torch.int64, LOWEST_KEY)
    counts = fusion.persistent_buffer("argmax counts", torch.device(DEVICE), 4, torch.int32, 0)
    assert (keys == LOWEST_KEY).all() and (counts == 0).all()


def test_switched_off_by_the_environment(monkeypatch):
    """NANOSERVE_FUSE_OFF=argmax takes the two kernels: the one-launch key buffer is left untouched."""
    monkeypatch.setenv("NANOSERVE_FUSE_OFF", "argmax")
    fusion.switch_fusions(None)
    try:
        assert not fusion.fusion_on("argmax") and fusion.fusion_on("merge")
        keys = fusion.persistent_buffer("argmax keys", torch.device(DEVICE), 2, torch.int64, LOWEST_KEY)
        keys[:2] = 123  # a one-launch call would read (and reset) these
        logits = torch.randn(2, 900, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        assert torch.equal(argmax(logits, 256), logits.argmax(dim=-1))
        assert keys[:2].tolist() == [123, 123]
        keys[:2] = LOWEST_KEY
    finally:
        monkeypatch.delenv("NANOSERVE_FUSE_OFF")
        fusion.switch_fusions(None)
    assert not fusion.fusion_on("argmax")  # unset: the measured default leaves the two kernels
    with pytest.raises(ValueError, match="unknown fusion"):
        fusion.switch_fusions("argmax,normqk")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_on_gpu(dtype):
    logits = torch.randn(4, 128256, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
    logits[2, [5, 70000]] = 40.0  # a tie across slices, exact in either dtype
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))


@pytest.mark.gpu
def test_one_pass_inside_a_cuda_graph():
    """Replays of a captured one-launch argmax over new logits: the counters reset inside the kernel."""
    static = torch.randn(1, 128256, device="cuda")
    argmax(static)  # compile and make the buffers outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax(static)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(20):
        static.copy_(torch.randn(1, 128256, device="cuda", generator=g))
        graph.replay()
        assert torch.equal(out, static.argmax(dim=-1))
