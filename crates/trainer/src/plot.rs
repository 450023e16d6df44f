//! placeholder
use std::path::{Path, PathBuf};
#[derive(Debug, Clone, clap::Args)]
pub struct PlotArgs { pub run_dir: PathBuf }
pub fn plot_run(_d: &Path) -> anyhow::Result<Vec<PathBuf>> { Ok(vec![]) }
