//! Pipeline parallelism: schedules as data ([`schedule`]), model stages ([`stage`]) and the
//! executor that runs a schedule over send/recv ([`executor`]).

pub mod executor;
pub mod schedule;
pub mod stage;
