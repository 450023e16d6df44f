//! How a schedule is written on a command line (`1f1b`, `interleaved:2`, `zb-v`) and printed.

use std::fmt;

use super::{ScheduleError, ScheduleKind};

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::GPipe => f.write_str("GPipe"),
            ScheduleKind::OneFOneB => f.write_str("1F1B"),
            ScheduleKind::Interleaved1F1B { virtual_stages } => {
                write!(f, "interleaved 1F1B (v = {virtual_stages})")
            }
            ScheduleKind::ZeroBubbleH1 => f.write_str("ZB-H1"),
            ScheduleKind::ZeroBubbleV => f.write_str("ZB-V"),
        }
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ScheduleError::UnknownKind(s.to_string());
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "zb-h1" => Ok(ScheduleKind::ZeroBubbleH1),
            "zb-v" => Ok(ScheduleKind::ZeroBubbleV),
            other => {
                let v = other.strip_prefix("interleaved:").ok_or_else(bad)?;
                let virtual_stages = v.parse().map_err(|_| bad())?;
                Ok(ScheduleKind::Interleaved1F1B { virtual_stages })
            }
        }
    }
}
