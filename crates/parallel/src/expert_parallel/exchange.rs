//! The ep group's row exchange as the hand-written backward takes it
//! ([`mtrain_model::tape::Exchange`]): the counts all-to-all, and the rows all-to-all that is
//! the dispatch one way and the combine the other; and the same two as the autograd path
//! records them (the differentiable all-to-all, [`super::all_to_all`]), so both paths issue the
//! same collectives.

use candle_core::{Device, Result, Tensor};
use mtrain_comm::Comm;
use mtrain_model::tape::Exchange;

use crate::ops::comm_err;

/// [`Exchange`] over an ep group, its counts on `device` (the layer's).
pub struct EpExchange {
    pub group: Comm,
    pub device: Device,
}

impl Exchange for EpExchange {
    fn size(&self) -> usize {
        self.group.size()
    }

    /// Each rank sends E_l counts to every rank (the rows it has for that rank's experts).
    fn counts(&self, counts: &[usize]) -> Result<Vec<usize>> {
        let ep = self.group.size();
        if !counts.len().is_multiple_of(ep) {
            return Err(candle_core::Error::Msg(format!(
                "expert-parallel counts: {} experts do not split over ep {ep}",
                counts.len()
            )));
        }
        let el = counts.len() / ep;
        let sent: Vec<u32> = counts.iter().map(|&c| c as u32).collect();
        let t = Tensor::from_vec(sent, counts.len(), &self.device)?; // (ep · E_l,)
        let got = super::MoeExchange::Counts
            .run(&t, &vec![el; ep], &vec![el; ep], &self.group)?
            .to_vec1::<u32>()?; // (ep · E_l,) entry s·E_l + j: from rank s for local expert j
        Ok(got.into_iter().map(|c| c as usize).collect())
    }

    fn rows(&self, x: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        self.group
            .all_to_all(&x.contiguous()?, send, recv)
            .map_err(comm_err) // (Σ recv, F)
    }

    fn dispatch(&self, x: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        super::MoeExchange::Dispatch.run(x, send, recv, &self.group) // (Σ recv, F)
    }

    fn combine(&self, y: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        super::MoeExchange::Combine.run(y, send, recv, &self.group) // (Σ send, F)
    }
}
