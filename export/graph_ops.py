"""What an exported graph is made of: its op counts, and whether its size arithmetic is plain.

A dynamic-resolution graph computes its position embeddings (absolute or rotary) from its input's H and W. It is
"plain" when it holds no control flow (`If`, `Loop`, `Scan`) and every `Range` takes bounds computed from the
Shape of a tensor and from constants only, never from a tensor's values: the graph TensorRT builds with a
dynamic profile (a data-dependent Range has no bound it can plan for, baaivision/EVA #117) and OpenVINO reads as
plain arithmetic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import onnx

CONTROL_FLOW = ("If", "Loop", "Scan")
# A tensor from one of these is a size, whatever its input's values.
_SIZE_OPS = ("Shape", "Size", "Constant", "ConstantOfShape")


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of `graph`, those of its subgraphs (an If's branches, a Loop's body) included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                yield from _nodes(sub)


def op_counts(proto: onnx.ModelProto) -> dict[str, int]:
    """op type -> how many nodes of it, subgraphs included, sorted by op type."""
    return dict(sorted(Counter(n.op_type for n in _nodes(proto.graph)).items()))


def _shape_only(graph: onnx.GraphProto) -> dict[str, bool]:
    """tensor name -> whether it is computed from sizes and constants only (graph inputs are data)."""
    known = {i.name: True for i in graph.initializer} | {i.name: False for i in graph.input}
    known[""] = True  # an omitted optional input
    for node in graph.node:  # topologically sorted (onnx.checker requires it)
        value = node.op_type in _SIZE_OPS or all(known.get(i, False) for i in node.input)
        for o in node.output:
            known[o] = value
    return known


@dataclass(frozen=True)
class GraphOps:
    """The ops of a graph (`ops`: op type -> count), its control-flow nodes and its data-dependent `Range`s."""

    ops: dict[str, int]
    control_flow: tuple[str, ...]
    data_ranges: tuple[str, ...]

    @property
    def count(self) -> int:
        """Nodes in all."""
        return sum(self.ops.values())

    @property
    def plain(self) -> bool:
        """No control flow and no Range whose bounds depend on a tensor's values."""
        return not self.control_flow and not self.data_ranges

    def summary(self) -> str:
        """One line: the node count and the op list, "Op xN" sorted by op type."""
        return f"{self.count} nodes: " + ", ".join(f"{op} x{n}" for op, n in self.ops.items())


def graph_ops(proto: onnx.ModelProto) -> GraphOps:
    """The ops of `proto` and what keeps it from being plain (module docstring)."""
    known = _shape_only(proto.graph)
    control = tuple(f"{n.op_type} {n.name}" for n in _nodes(proto.graph) if n.op_type in CONTROL_FLOW)
    ranges = tuple(n.name or n.output[0] for n in proto.graph.node
                   if n.op_type == "Range" and not all(known.get(i, False) for i in n.input))
    return GraphOps(op_counts(proto), control, ranges)
