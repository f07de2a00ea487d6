//! Member access for the Partial Parity Log's work at assembly ([`engine::ppl::recover`],
//! [`engine::ppl::reinit_areas`]): files and block devices by path, before the reactors
//! open their queues.
//!
//! Plain positioned I/O (`pread`/`pwrite`) and `fdatasync`, like the superblock's
//! ([`crate::metadata_io`]): the page cache is coherent with the block device, and every
//! write is made durable before the array serves. Members reached only through their back
//! end (`/dev/ngXnY`, `vfio:BDF`) are refused here for now, with a clear error.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use engine::device::IoError;
use engine::ppl::PplMedia;

/// Why the members could not be opened for PPL work.
#[derive(Debug, thiserror::Error)]
pub enum PplOpenError {
    /// The operating system refused to open the member.
    #[error("{path}: open for PPL recovery: {source}", path = path.display())]
    Open {
        /// The member.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A member reached only through its back end.
    #[error(
        "{path}: PPL arrays over members reached through their back end (NVMe generic \
         devices, vfio) are not served yet",
        path = path.display()
    )]
    BackEnd {
        /// The member.
        path: PathBuf,
    },
}

/// The members of an array by role, opened for PPL recovery; `None` for a missing role.
pub struct PplFiles {
    files: Vec<Option<(PathBuf, File)>>,
    /// The first OS error, with the member and what was done (the engine's
    /// [`IoError`] carries only an errno).
    first_error: Option<String>,
}

impl PplFiles {
    /// Opens `paths[role]` read-write for every present role.
    ///
    /// # Errors
    /// [`PplOpenError::Open`] for a member that cannot be opened;
    /// [`PplOpenError::BackEnd`] for one reached only through its back end (an NVMe generic
    /// device or a vfio controller: PPL arrays over those are not served yet).
    pub fn open(paths: &[Option<PathBuf>]) -> Result<Self, PplOpenError> {
        let mut files = Vec::with_capacity(paths.len());
        for p in paths {
            let Some(p) = p else {
                files.push(None);
                continue;
            };
            if crate::metadata_io::uses_back_end(p) {
                return Err(PplOpenError::BackEnd { path: p.clone() });
            }
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .map_err(|source| PplOpenError::Open {
                    path: p.clone(),
                    source,
                })?;
            files.push(Some((p.clone(), f)));
        }
        Ok(PplFiles {
            files,
            first_error: None,
        })
    }

    /// The first failed operation, described with its member's path.
    pub fn first_error(&self) -> Option<&str> {
        self.first_error.as_deref()
    }

    fn file(&self, member: u16) -> Result<&File, IoError> {
        match self.files.get(usize::from(member)) {
            Some(Some((_, f))) => Ok(f),
            // A missing role: recovery never addresses one (the caller passes `present`).
            _ => Err(IoError::Io { errno: 6 }),
        }
    }

    fn note(&mut self, member: u16, what: &str, e: &io::Error) -> IoError {
        if self.first_error.is_none() {
            let path = self.files[usize::from(member)]
                .as_ref()
                .map(|(p, _)| p.display().to_string())
                .unwrap_or_default();
            self.first_error = Some(format!("{path}: {what}: {e}"));
        }
        IoError::Io {
            errno: e.raw_os_error().unwrap_or(5),
        }
    }
}

impl PplMedia for PplFiles {
    fn read(&mut self, member: u16, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let f = self.file(member)?;
        match f.read_exact_at(buf, offset) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.note(member, "PPL recovery read", &e)),
        }
    }

    fn write(&mut self, member: u16, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let f = self.file(member)?;
        match f.write_all_at(buf, offset) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.note(member, "PPL recovery write", &e)),
        }
    }

    fn flush(&mut self, member: u16) -> Result<(), IoError> {
        let f = self.file(member)?;
        match f.sync_data() {
            Ok(()) => Ok(()),
            Err(e) => Err(self.note(member, "PPL recovery sync", &e)),
        }
    }
}
