// Embedding gradient (see kernels/embedding.rs). Appended to kernels.cu by kernels/mod.rs.
