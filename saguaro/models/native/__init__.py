"""saguaro's own CPU kernels (group_matmul.c, decoder_layer.c, repack.c; token_mask.c for
grammars' masks), compiled with the system C compiler at first use.

A decode step streams every weight once, so its speed is the bytes it reads per token. torch's
int4 kernel reads a GGUF's 4-bit weights with bf16 scales and zeros, and no torch kernel reads
8-bit blocks, so a Q8_0 head (the tied embedding of most GGUF files) would run as a bf16 matrix
twice its size. group_matmul.c reads both at their own density and multiplies as llama.cpp does:
activations rounded to 8 bits per group of 32, integer dot products (AVX512-VNNI, or AVX2's byte
pair products), fp32 sums. Each row is computed alone (batch-invariant). decoder_layer.c runs a
whole decoder layer in one call.

compiler.py builds the library, bindings.py loads it and declares its calls, packing.py lays
weights out in its tiles, layers.py runs a model's layers with it.
"""
