"""The plain backend: training through the maintained, inference-only `onnxruntime`.

torch's autograd builds the backward: aot_autograd traces the joint forward + backward graph
of a call (`capture`), with the operators ONNX cannot express decomposed by the project's own
table (`decompositions`), and the min-cut partitioner splits it into a forward and a backward
FX graph. Each graph is translated to ONNX (`lowering`) and runs in its own InferenceSession;
an autograd Function ties the two into PyTorch's autograd (`program`), and the first call of
every graph is checked against eager before its numbers are trusted.
"""

#: The torch.library namespace of the operators this backend defines for its graphs (the
#: recurrent scans, `windows`' SpaceToDepth, `norms`', `convolutions`', `linears`' and
#: `matmuls`' operators), each with an ONNX translation
#: (`lowering.our_translations`).
OPERATOR_NAMESPACE = "ort_autopatch"
