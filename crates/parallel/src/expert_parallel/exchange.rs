//! The ep group's row exchange as the hand-written backward takes it
//! ([`mtrain_model::tape::Exchange`]): the counts all-to-all, and the rows all-to-all that is
//! the dispatch one way and the combine the other, around the experts, waited inline or
//! overlapped with the experts of the neighbouring parts of the tokens ([`super::overlap`]);
//! and the same two as the autograd path records them (the differentiable all-to-all,
//! [`super::all_to_all`]), so both paths issue the same collectives.

use candle_core::{Device, Result, Tensor};
use mtrain_comm::Comm;
use mtrain_model::tape::{Exchange, PartRows};

use crate::ops::comm_err;

/// [`Exchange`] over an ep group, its counts on `device` (the layer's).
pub struct EpExchange {
    pub group: Comm,
    pub device: Device,
    /// Pipelined overlap (`--ep-overlap`): the tokens in [`super::overlap::PARTS`] parts,
    /// each part's all-to-alls on the wire while a neighbouring part's experts compute.
    pub overlap: bool,
}

impl EpExchange {
    /// The rows all-to-all, waited: block p of x (`send[p]` rows, F) to rank p; the blocks
    /// received from ranks 0, 1, … (`recv[s]` rows each).
    fn rows(&self, x: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        self.group
            .all_to_all(&x.contiguous()?, send, recv)
            .map_err(comm_err) // (Σ recv, F)
    }
}

impl Exchange for EpExchange {
    fn size(&self) -> usize {
        self.group.size()
    }

    fn parts(&self) -> usize {
        match self.overlap {
            true => super::overlap::PARTS,
            false => 1,
        }
    }

    /// Each rank sends m counts to every rank (the rows it has for that rank's experts, part
    /// by part).
    fn counts(&self, counts: &[usize]) -> Result<Vec<usize>> {
        let ep = self.group.size();
        if !counts.len().is_multiple_of(ep) {
            return Err(candle_core::Error::Msg(format!(
                "expert-parallel counts: {} counts do not split over ep {ep}",
                counts.len()
            )));
        }
        let m = counts.len() / ep;
        let sent: Vec<u32> = counts.iter().map(|&c| c as u32).collect();
        let t = Tensor::from_vec(sent, counts.len(), &self.device)?; // (ep · m,)
        let got = super::MoeExchange::Counts
            .run(&t, &vec![m; ep], &vec![m; ep], &self.group)?
            .to_vec1::<u32>()?; // (ep · m,) entry s·m + i: rank s's count i
        Ok(got.into_iter().map(|c| c as usize).collect())
    }

    fn round_trip(
        &self,
        parts: Vec<PartRows<'_>>,
        experts: &mut dyn FnMut(usize, Tensor) -> Result<Tensor>,
        tail: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<Tensor>> {
        if self.overlap {
            return super::overlap::pipelined(&self.group, parts, experts, tail);
        }
        let mut back = Vec::with_capacity(parts.len());
        for (i, p) in parts.into_iter().enumerate() {
            let x = self.rows(&p.x, p.send, p.recv)?; // (R_i, F) by source rank
            let y = experts(i, x)?; // (R_i, F)
            back.push(self.rows(&y, p.recv, p.send)?); // (S_i, F)
        }
        tail()?;
        Ok(back)
    }

    fn dispatch(&self, x: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        super::MoeExchange::Dispatch.run(x, send, recv, &self.group) // (Σ recv, F)
    }

    fn combine(&self, y: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        super::MoeExchange::Combine.run(y, send, recv, &self.group) // (Σ send, F)
    }
}
