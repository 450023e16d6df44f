// Fused AdamW (see kernels/adamw.rs). Appended to kernels.cu by kernels/mod.rs.
