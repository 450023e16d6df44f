//! Where a collective was issued: the file and line of the call into the [`Communicator`].
//!
//! Every op of every backend records its [`Site`] in its [`TraceEvent`] (`--trace` writes it
//! as `"site"`), and a timeout or a lost peer names it, so a rank that hangs says which line of
//! which technique it waits in:
//!
//! ```text
//!   all_reduce on group 'tp' (seq 42) timed out after 60000 ms on rank 1 waiting for rank 0,
//!   issued at crates/parallel/src/tensor_parallel/mapping.rs:88
//! ```
//!
//! The methods of [`Communicator`] are `#[track_caller]`, so the site is the first caller
//! outside this crate that is not itself `#[track_caller]`: a helper that issues collectives
//! for its callers (a differentiable collective, a gather along a dimension) marks itself
//! `#[track_caller]` to pass its caller's line through. Paths are relative to the workspace
//! root, as cargo compiles the workspace's crates.
//!
//! [`Communicator`]: crate::Communicator
//! [`TraceEvent`]: crate::TraceEvent

use std::fmt;
use std::panic::Location;

/// The file and line a collective was issued from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Site(&'static Location<'static>);

impl Site {
    /// The caller's location, seen through every `#[track_caller]` function above it.
    #[track_caller]
    pub fn caller() -> Site {
        Site(Location::caller())
    }

    /// The source file, relative to the workspace root (`crates/parallel/src/...`).
    pub fn file(&self) -> &'static str {
        self.0.file()
    }

    pub fn line(&self) -> u32 {
        self.0.line()
    }
}

impl fmt::Display for Site {
    /// `file:line`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.0.file(), self.0.line())
    }
}

impl fmt::Debug for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl serde::Serialize for Site {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn passes_through() -> Site {
        Site::caller()
    }

    /// A `#[track_caller]` helper reports its caller's line, not its own.
    #[test]
    fn the_site_is_the_first_caller_that_does_not_pass_it_on() {
        let (here, line) = (passes_through(), line!());
        assert_eq!(here.file(), "crates/comm/src/site.rs");
        assert_eq!(here.line(), line);
        assert_eq!(here.to_string(), format!("crates/comm/src/site.rs:{line}"));
    }
}
