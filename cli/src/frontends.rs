//! The front-end each reactor runs: NBD, iSCSI and NVMe/TCP side by side on the same
//! reactor.
//!
//! [`TargetFrontend`] polls each every loop turn and routes each array completion back to
//! the front-end that submitted it by its tag: the iSCSI front-end sets
//! [`crate::iscsi::frontend::TAG_BIT`] (bit 63) on its tags, the NVMe/TCP front-end
//! [`crate::nvmf::frontend::TAG_BIT`] (bit 62); NBD tags are context indexes below 2^16.

use engine::array::ArrayCompletion;
use engine::device::Channel;
use engine::reactor::{Frontend, Io};

use crate::iscsi::frontend::TAG_BIT;
use crate::iscsi::IscsiFrontend;
use crate::nbd::NbdFrontend;
use crate::nvmf::frontend::TAG_BIT as NVMF_TAG_BIT;
use crate::nvmf::NvmfFrontend;

/// One reactor's front-ends: NBD always, iSCSI when the target serves it.
pub struct TargetFrontend {
    /// The NBD front-end.
    pub nbd: NbdFrontend,
    /// The iSCSI front-end, if iSCSI is served.
    pub iscsi: Option<IscsiFrontend>,
    /// The NVMe/TCP front-end, if NVMe/TCP is served.
    pub nvmf: Option<NvmfFrontend>,
}

impl TargetFrontend {
    /// One `TargetFrontend` per reactor, in reactor order, from each server's front-ends
    /// (as their builders' `start(reactors)` return them: one per reactor, in reactor
    /// order). `iscsi` and `nvmf` are empty when that front is not served.
    pub fn per_reactor(
        nbd: Vec<NbdFrontend>,
        iscsi: Vec<IscsiFrontend>,
        nvmf: Vec<NvmfFrontend>,
    ) -> Vec<TargetFrontend> {
        let mut iscsi = iscsi.into_iter();
        let mut nvmf = nvmf.into_iter();
        nbd.into_iter()
            .map(|nbd| TargetFrontend {
                nbd,
                iscsi: iscsi.next(),
                nvmf: nvmf.next(),
            })
            .collect()
    }
}

impl Frontend for TargetFrontend {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        let mut progress = self.nbd.poll(io);
        if let Some(i) = self.iscsi.as_mut() {
            progress |= i.poll(io);
        }
        if let Some(n) = self.nvmf.as_mut() {
            progress |= n.poll(io);
        }
        progress
    }

    fn complete(&mut self, c: ArrayCompletion) {
        match self.iscsi.as_mut() {
            Some(i) if c.tag & TAG_BIT != 0 => i.complete(c),
            _ => match self.nvmf.as_mut() {
                Some(n) if c.tag & NVMF_TAG_BIT != 0 => n.complete(c),
                _ => self.nbd.complete(c),
            },
        }
    }

    fn finished(&self) -> bool {
        self.nbd.finished()
            && self.iscsi.as_ref().is_none_or(|i| i.finished())
            && self.nvmf.as_ref().is_none_or(|n| n.finished())
    }
}
