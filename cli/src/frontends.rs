//! The front-end each reactor runs: NBD and iSCSI side by side on the same reactor.
//!
//! [`TargetFrontend`] polls both every loop turn and routes each array completion back to
//! the front-end that submitted it by its tag: the iSCSI front-end sets
//! [`crate::iscsi::frontend::TAG_BIT`] (bit 63) on its tags; NBD tags are context indexes
//! below 2^16.

use engine::array::ArrayCompletion;
use engine::device::Channel;
use engine::reactor::{Frontend, Io};

use crate::iscsi::frontend::TAG_BIT;
use crate::iscsi::IscsiFrontend;
use crate::nbd::NbdFrontend;

/// One reactor's front-ends: NBD always, iSCSI when the target serves it.
pub struct TargetFrontend {
    /// The NBD front-end.
    pub nbd: NbdFrontend,
    /// The iSCSI front-end, if iSCSI is served.
    pub iscsi: Option<IscsiFrontend>,
}

impl Frontend for TargetFrontend {
    fn poll<C: Channel>(&mut self, io: &mut Io<'_, C>) -> bool {
        let mut progress = self.nbd.poll(io);
        if let Some(i) = self.iscsi.as_mut() {
            progress |= i.poll(io);
        }
        progress
    }

    fn complete(&mut self, c: ArrayCompletion) {
        match self.iscsi.as_mut() {
            Some(i) if c.tag & TAG_BIT != 0 => i.complete(c),
            _ => self.nbd.complete(c),
        }
    }

    fn finished(&self) -> bool {
        self.nbd.finished() && self.iscsi.as_ref().is_none_or(|i| i.finished())
    }
}
