//! mtrain-model: a single-device GPT on candle, its MoE variant, and the block-wise engine.
//! Nothing here knows about ranks; parallel strategies wrap these pieces. The operations the
//! layers and the hand-written backward passes compute with (fused CUDA kernels or candle ops,
//! each op choosing) are the `mtrain_kernels` crate's.
//!
//! # Layout
//! - [`config`]: `GptConfig` / `MoeConfig`, presets, parameter and FLOP counts.
//! - [`param`]: `Param` (a name and a swappable `Var`) and `Grads` (gradients by name).
//! - [`init`]: layout-independent initialisation, each element a counter-based draw keyed by
//!   (seed, name, index), readable a region at a time (`SeededInit`).
//! - [`layers`]: `Linear`, `LayerNorm`, `Mlp`, `CausalSelfAttention`, the `FeedForward` trait.
//! - [`vocab`]: the tied vocabulary whole or split by rows, as the embedding (`VocabRows`) and
//!   the head (`VocabLoss`) see it; `AllRows`, the whole of it.
//! - [`moe`]: top-k routing with capacity, the one experts layer (all experts here, or a rank's
//!   with the group's exchange) and its auxiliary losses.
//! - [`gpt`]: the model as a list of segments (embedding, blocks, head).
//! - [`decode`]: generation, the whole context per token or with a KV cache (prefill once,
//!   then one position per token).
//! - [`tape`]: `Tape`, what a segment's graph-free forward keeps for its hand-written backward;
//!   `Collective` and `Exchange`, the communication a sharded layer hands its tape.
//! - [`explicit`]: the tapes (hand-written backward) of the embedding, the block (dense, tensor-
//!   parallel, or a mixture of experts on one device or across an ep group) and the head.
//! - [`engine`]: forward/backward one segment at a time with hooks and activation checkpointing;
//!   its `Backward` value says where the tapes replace autograd.
//! - [`dropout`]: dropout at nanoGPT's sites, its masks keyed by the global place of each
//!   element ([`Draw`]), so every layout and every recompute draws them alike.
//! - [`optim`]: AdamW (state by name), the learning-rate schedule, clipping.
//! - [`source`]: `ParamSource`, the values of any region of a parameter (runs of its
//!   row-major elements), so a rank reads only the piece it holds.

pub mod chunks;
pub mod config;
pub mod decode;
pub mod dropout;
pub mod engine;
pub mod explicit;
pub mod gpt;
pub mod init;
pub mod layers;
pub mod moe;
pub mod optim;
pub mod param;
pub mod source;
pub mod tape;
pub mod vocab;

pub use chunks::SequenceChunks;
pub use config::{ConfigError, GptConfig, MoeConfig};
pub use decode::{Decoder, KvCache};
pub use dropout::{Draw, StepDraw};
pub use engine::{Activations, Backward, Engine, HookResult, Hooks, NoHooks, PendingGrads};
pub use gpt::{Block, BlockSegment, Embedding, Gpt, Head, Segment, SegmentOut};
pub use init::{init_weights, SeededInit};
pub use layers::{CausalSelfAttention, DenseLinear, FeedForward, FfnOut, LayerNorm, Linear, Mlp};
pub use moe::{MoeLayer, MoeStats};
pub use param::{Grads, Param};
