"""The torch-free contract every stage shares: the checkpoint manifest and files, the INT8/N:M numerics,
the tokenizer loader and the ONNX Runtime session builder. Nothing here imports torch."""
