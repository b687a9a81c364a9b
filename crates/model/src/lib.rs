//! `model`: Llama and Mixtral-style decoders built from layers with explicit,
//! separable forward/backward over flat parameter and gradient buffers.
