//! Latency models of real device classes.
//!
//! A request's service time is `base latency + positioning + bytes / bandwidth`. A device
//! serves at most `parallelism` requests at once (NAND channels/dies, one head for a disk);
//! more queue in the device up to `queue_depth`, beyond which `submit` reports the queue
//! full. A write cache makes writes complete at cache speed and moves their media cost to
//! the next flush (or FUA). A *bounded* write cache (`write_cache_bytes`) instead destages
//! continuously at the media's aggregate write bandwidth (`write_bytes_per_s ×
//! parallelism`); a write that finds it full waits inside the device, holding its parallel
//! unit (its command slot), until the destage has made room — so under a heavy writer,
//! reads queue behind writes inside the device (the SATA-SSD behaviour blk-wbt was built
//! for), and a flush waits for the destage to finish.
//!
//! The figures are typical datasheet/measured values for each class, chosen to reproduce
//! the qualitative behaviour the engine must handle (deep parallel queues vs. a single
//! seeking head), not any one product.

/// How a device pays for moving between LBAs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Seek {
    /// Solid state: no positioning cost.
    None,
    /// A rotating disk: a request that does not start where the previous one ended pays an
    /// average seek plus half a rotation.
    Disk {
        /// Average seek time, ns.
        avg_seek_ns: u64,
        /// Time of one full rotation, ns (8.33 ms at 7200 rpm).
        rotation_ns: u64,
    },
}

/// A latency model.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// Name for logs and reports.
    pub name: &'static str,
    /// Fixed read latency per request (command overhead + media access), ns.
    pub read_latency_ns: u64,
    /// Fixed write latency per request to the media, ns.
    pub write_latency_ns: u64,
    /// Media read bandwidth per parallel unit, bytes/s.
    pub read_bytes_per_s: u64,
    /// Media write bandwidth per parallel unit, bytes/s.
    pub write_bytes_per_s: u64,
    /// Requests served concurrently.
    pub parallelism: u32,
    /// Requests the device accepts at once (its queue depth): NVMe 1023, NCQ 32, QD1 disk 1.
    pub queue_depth: u32,
    /// Latency of a write absorbed by a volatile write cache, ns; `None` = no cache (writes
    /// go to the media before completing).
    pub write_cache_latency_ns: Option<u64>,
    /// Capacity of the write cache, bytes: `None` = unbounded (writes are paid for at the
    /// next flush); `Some` = bounded, destaging continuously (see the module docs).
    pub write_cache_bytes: Option<u64>,
    /// Positioning model.
    pub seek: Seek,
}

impl Profile {
    /// A datacenter NVMe SSD: ~80 µs reads, ~20 µs writes (power-loss-protected cache
    /// behaves as media), 32 parallel units of ~100 MB/s each (≈3.2 GB/s), queue depth 1023.
    pub fn nvme_ssd() -> Self {
        Self {
            name: "nvme-ssd",
            read_latency_ns: 80_000,
            write_latency_ns: 20_000,
            read_bytes_per_s: 100_000_000,
            write_bytes_per_s: 64_000_000,
            parallelism: 32,
            queue_depth: 1023,
            write_cache_latency_ns: None,
            write_cache_bytes: None,
            seek: Seek::None,
        }
    }

    /// A SATA SSD with a volatile write cache: ~100 µs reads, writes acknowledged from
    /// cache in ~25 µs and written to NAND at ~500 MB/s, 4 parallel units, NCQ depth 32.
    pub fn sata_ssd_cached() -> Self {
        Self {
            name: "sata-ssd-cached",
            read_latency_ns: 100_000,
            write_latency_ns: 200_000,
            read_bytes_per_s: 137_500_000,
            write_bytes_per_s: 125_000_000,
            parallelism: 4,
            queue_depth: 32,
            write_cache_latency_ns: Some(25_000),
            write_cache_bytes: None,
            seek: Seek::None,
        }
    }

    /// [`Profile::sata_ssd_cached`] with a bounded 64 MiB write cache destaging at
    /// 500 MB/s: writes are acknowledged in 25 µs while the cache has room; under a
    /// sustained writer the cache fills, writes wait in the device's 32 NCQ slots for
    /// room, and reads queue behind them (see the module docs). The seed scenario's
    /// SATA-SSD-with-cache profile.
    pub fn sata_ssd_bounded_cache() -> Self {
        Self {
            name: "sata-ssd-bounded-cache",
            write_cache_bytes: Some(64 << 20),
            ..Self::sata_ssd_cached()
        }
    }

    /// A 7200 rpm SATA disk: 8.5 ms average seek, 8.33 ms rotation, ~200 MB/s sequential,
    /// one head; `ncq` selects queue depth 32 (else 1: the QD=1 disk).
    pub fn hdd_7200(ncq: bool) -> Self {
        Self {
            name: if ncq { "hdd-7200-ncq" } else { "hdd-7200-qd1" },
            read_latency_ns: 100_000,
            write_latency_ns: 100_000,
            read_bytes_per_s: 200_000_000,
            write_bytes_per_s: 200_000_000,
            parallelism: 1,
            queue_depth: if ncq { 32 } else { 1 },
            write_cache_latency_ns: None,
            write_cache_bytes: None,
            seek: Seek::Disk {
                avg_seek_ns: 8_500_000,
                rotation_ns: 8_333_333,
            },
        }
    }

    /// An ideal device: every request takes exactly `latency_ns`, unlimited parallelism.
    /// For tests that want time to move but no queueing effects.
    pub fn fixed(latency_ns: u64) -> Self {
        Self {
            name: "fixed",
            read_latency_ns: latency_ns,
            write_latency_ns: latency_ns,
            read_bytes_per_s: u64::MAX,
            write_bytes_per_s: u64::MAX,
            parallelism: u32::MAX,
            queue_depth: 1024,
            write_cache_latency_ns: None,
            write_cache_bytes: None,
            seek: Seek::None,
        }
    }

    /// Media transfer time of `bytes` at `bytes_per_s`, ns.
    pub(crate) fn transfer_ns(bytes: u64, bytes_per_s: u64) -> u64 {
        if bytes_per_s == u64::MAX {
            return 0;
        }
        let ns = u128::from(bytes) * 1_000_000_000 / u128::from(bytes_per_s.max(1));
        u64::try_from(ns).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_times() {
        assert_eq!(
            Profile::transfer_ns(200_000_000, 200_000_000),
            1_000_000_000
        );
        assert_eq!(Profile::transfer_ns(4096, u64::MAX), 0);
        assert_eq!(Profile::transfer_ns(u64::MAX, 1), u64::MAX);
    }
}
