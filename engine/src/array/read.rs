//! Reads of healthy members, straight into the caller's buffer.

use crate::device::{Channel, Op};

use super::{Array, Phase};

impl<C: Channel> Array<C> {
    // ---- reads -----------------------------------------------------------------------------

    pub(super) fn start_read(&mut self, s: u32) {
        let g = *self.geo.geometry();
        let st = self.geo.stripe(self.sops[s as usize].stripe);
        let w = self.footprint(s);
        let healthy = w.chunks().all(|(k, _)| !self.missing(s, st.data_member(k)));
        if !healthy {
            return self.start_degraded(s, Phase::DegradedRead);
        }
        self.sops[s as usize].phase = Phase::DirectRead;
        self.sops[s as usize].io_error = false;
        let c = u64::from(g.chunk_bytes());
        for (k, r) in w.chunks() {
            let ptr = self.client_ptr(s, u64::from(k) * c + u64::from(r.start));
            self.io(s, st.data_member(k), Op::Read, r.start, r.len(), ptr);
        }
    }
}
