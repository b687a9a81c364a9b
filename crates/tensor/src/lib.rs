//! `tensor`: contiguous row-major tensors and the numerical kernels of xtrain
//! (matrix products, norms, RoPE, activations, attention, cross-entropy, embedding),
//! each with an explicit forward and backward.
