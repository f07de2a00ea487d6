//! The [`ReservationStore`] of a running array: the persistent-reservation record on every
//! member ([`engine::metadata::pr_record`], bytes 0..4096 of each member, before the md
//! superblock), so APTPL state survives a restart of the target and the members moving to
//! another machine (docs/FORMAT.md, "The persistent-reservation record").
//!
//! Saves run on the iSCSI server's persister thread, never on a reactor: each is a blocking
//! `pwrite` + `fdatasync` of 4 KiB per member (or a FUA write through an NVMe/vfio back
//! end).

use std::io;
use std::path::PathBuf;
use std::sync::Mutex;

use drivers::metadata_io;
use engine::metadata::pr_record::{self, PrRecordError, PR_PAYLOAD_MAX_BYTES};
use engine::metadata::Uuid;
use tracing::warn;

use super::pr_store::ReservationStore;

/// The members a save goes to: called on every load and save, so members that failed or
/// joined since the start (a rebuilt replacement) are followed.
pub type MemberPaths = Box<dyn Fn() -> Vec<PathBuf> + Send + Sync>;

/// The persistent-reservation record kept on the members of array `uuid`.
pub struct MemberStore {
    uuid: Uuid,
    members: MemberPaths,
    /// The generation of the newest record seen or written (saves go one above).
    generation: Mutex<u64>,
}

impl MemberStore {
    /// A store for array `uuid` over the working members `members` returns.
    pub fn new(uuid: Uuid, members: MemberPaths) -> Self {
        Self {
            uuid,
            members,
            generation: Mutex::new(0),
        }
    }
}

impl ReservationStore for MemberStore {
    /// Reads every member's record area and returns the newest valid record's payload. A
    /// member that cannot be read or holds a damaged record is logged and skipped (its
    /// peers hold the record); only when records exist but none is valid is it an error.
    ///
    /// # Errors
    /// [`io::ErrorKind::InvalidData`] when every record found is damaged (nothing is
    /// guessed: the operator must look); [`io::ErrorKind::NotFound`] when no member can be
    /// read at all.
    fn load(&self) -> io::Result<Option<Vec<u8>>> {
        let paths = (self.members)();
        let mut areas = Vec::with_capacity(paths.len());
        for p in &paths {
            match metadata_io::read_pr_record_area(p) {
                Ok(a) => areas.push(Some(a)),
                Err(e) => {
                    warn!(member = %p.display(), "persistent-reservation record unreadable: {e}");
                    areas.push(None);
                }
            }
        }
        if !paths.is_empty() && areas.iter().all(Option::is_none) {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "no member's persistent-reservation record could be read",
            ));
        }
        let newest = pr_record::newest(areas.iter().map(|a| a.as_deref()), self.uuid);
        for (i, e) in &newest.damaged {
            warn!(member = %paths[*i].display(), "persistent-reservation record ignored: {e}");
        }
        let mut generation = self.generation.lock().unwrap_or_else(|e| e.into_inner());
        match newest.record {
            Some(r) => {
                *generation = (*generation).max(r.generation);
                Ok((!r.payload.is_empty()).then_some(r.payload))
            }
            None if !newest.damaged.is_empty() => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "every persistent-reservation record found is damaged ({} of them; first: {})",
                    newest.damaged.len(),
                    newest.damaged[0].1
                ),
            )),
            None => Ok(None),
        }
    }

    /// Writes generation N+1 holding `state` to every member and syncs it. Succeeds when at
    /// least one member has it durably (a restart then finds it; the members that failed
    /// to take it are logged — a member failing writes is failed by the array anyway).
    ///
    /// # Errors
    /// [`io::ErrorKind::StorageFull`] when `state` is longer than
    /// [`PR_PAYLOAD_MAX_BYTES`] (SPC-4's INSUFFICIENT REGISTRATION RESOURCES case);
    /// the first member's error when no member took the record.
    fn save(&self, state: &[u8]) -> io::Result<()> {
        let mut generation = self.generation.lock().unwrap_or_else(|e| e.into_inner());
        let next = *generation + 1;
        let area = pr_record::encode(self.uuid, next, state).map_err(|e| match e {
            PrRecordError::TooLong { .. } => io::Error::new(io::ErrorKind::StorageFull, e),
            e => io::Error::other(e),
        })?;
        debug_assert!(state.len() <= PR_PAYLOAD_MAX_BYTES);
        let paths = (self.members)();
        let mut first_error = None;
        let mut written = 0;
        for p in &paths {
            match metadata_io::write_pr_record_area(p, &area) {
                Ok(()) => written += 1,
                Err(e) => {
                    warn!(member = %p.display(), "persistent-reservation record not written: {e}");
                    first_error.get_or_insert(e);
                }
            }
        }
        if written == 0 {
            return Err(match first_error {
                Some(e) => io::Error::other(e),
                None => io::Error::new(io::ErrorKind::NotFound, "the array has no member to write"),
            });
        }
        *generation = next;
        Ok(())
    }

    /// [`PR_PAYLOAD_MAX_BYTES`]: what the 4 KiB record holds.
    fn capacity_bytes(&self) -> Option<usize> {
        Some(PR_PAYLOAD_MAX_BYTES)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::sync::Arc;

    fn members(dir: &std::path::Path, n: usize) -> Vec<PathBuf> {
        (0..n)
            .map(|i| {
                let p = dir.join(format!("m{i}"));
                fs::File::create(&p).unwrap().set_len(1 << 20).unwrap();
                p
            })
            .collect()
    }

    #[test]
    fn saves_reach_every_member_and_a_new_store_loads_the_newest() {
        let tmp = tempfile::tempdir().unwrap();
        let paths = Arc::new(members(tmp.path(), 3));
        let u = Uuid([3; 16]);
        let p = Arc::clone(&paths);
        let store = MemberStore::new(u, Box::new(move || p.to_vec()));
        assert_eq!(store.load().unwrap(), None);
        store.save(b"one").unwrap();
        store.save(b"two").unwrap();
        for m in paths.iter() {
            let a = metadata_io::read_pr_record_area(m).unwrap();
            let r = pr_record::decode(&a, u).unwrap().unwrap();
            assert_eq!((r.generation, r.payload.as_slice()), (2, &b"two"[..]));
            // Nothing past the record area was touched.
            assert!(fs::read(m).unwrap()[4096..].iter().all(|&b| b == 0));
        }
        // A member that missed the last save (older generation) and one torn: the newest
        // valid copy wins; a fresh store (a restarted target) continues above it.
        metadata_io::write_pr_record_area(&paths[0], &pr_record::encode(u, 1, b"old").unwrap())
            .unwrap();
        let mut torn = *pr_record::encode(u, 3, b"torn").unwrap();
        torn[60] ^= 1;
        metadata_io::write_pr_record_area(&paths[1], &torn).unwrap();
        let p = Arc::clone(&paths);
        let again = MemberStore::new(u, Box::new(move || p.to_vec()));
        assert_eq!(again.load().unwrap().as_deref(), Some(&b"two"[..]));
        again.save(b"").unwrap();
        assert_eq!(again.load().unwrap(), None, "an empty save clears");
        let a = metadata_io::read_pr_record_area(&paths[2]).unwrap();
        assert_eq!(pr_record::decode(&a, u).unwrap().unwrap().generation, 3);
    }

    #[test]
    fn damage_everywhere_is_an_error_and_too_much_state_is_storage_full() {
        let tmp = tempfile::tempdir().unwrap();
        let paths = members(tmp.path(), 2);
        let u = Uuid([4; 16]);
        let mut torn = *pr_record::encode(u, 1, b"x").unwrap();
        torn[50] ^= 1;
        for m in &paths {
            metadata_io::write_pr_record_area(m, &torn).unwrap();
        }
        let p = paths.clone();
        let store = MemberStore::new(u, Box::new(move || p.clone()));
        assert_eq!(store.load().unwrap_err().kind(), io::ErrorKind::InvalidData);
        let big = vec![1u8; PR_PAYLOAD_MAX_BYTES + 1];
        assert_eq!(
            store.save(&big).unwrap_err().kind(),
            io::ErrorKind::StorageFull
        );
        // Another array's record is not ours: no state.
        let other = pr_record::encode(Uuid([5; 16]), 9, b"theirs").unwrap();
        for m in &paths {
            metadata_io::write_pr_record_area(m, &other).unwrap();
        }
        assert_eq!(store.load().unwrap(), None);
        let gone = MemberStore::new(u, Box::new(|| vec![PathBuf::from("/nonexistent/m")]));
        assert!(gone.load().is_err() && gone.save(b"s").is_err());
    }
}
