"""Reading the kernels of a captured CUDA graph from its DOT dump (a real H200 dump as fixture)."""

from pathlib import Path

from replay.record.cuda_graphs import parse_dot_kernels

DOT = Path(__file__).parent / "data" / "graph_h200.dot"


def test_kernels_names_and_launch_shapes_in_node_order():
    kernels = parse_dot_kernels(DOT.read_text())
    assert len(kernels) == 3
    gemm, clamp, reduce = kernels
    assert gemm["name"].startswith("sm80_xmma_gemm_f32f32") and gemm["grid"] == [2, 2, 1] and gemm["block"] == [64, 1, 1]
    assert "vectorized_elementwise_kernel" in clamp["name"] and clamp["grid"] == [4, 1, 1] and clamp["block"] == [128, 1, 1]
    assert "reduce_kernel" in reduce["name"] and reduce["block"] == [16, 8, 1]


def test_non_kernel_nodes_and_garbage_are_ignored():
    assert parse_dot_kernels("digraph dot {}") == []
    assert parse_dot_kernels('"graph_1_node_0"[label="{MEMSET | {ID | 0}}"];\n') == []
