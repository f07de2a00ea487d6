//! Closed-loop client jobs against an [`Array`] of simulated members, in virtual time.
//!
//! [`run`] is a single-threaded executor: each [`Job`] keeps up to `depth` requests of
//! `block_bytes` outstanding while it is active (`start_ns..stop_ns`), submitting them at
//! least `submit_gap_ns` apart, the array runs, and the clock jumps to the next member
//! completion (or job start/stop, end of a submission gap, or sample tick) when nothing
//! else can happen. Same seed, same result. Used by the QoS tests, the seed scenario
//! benchmark (`bench/src/bin/qos-scenario.rs`) and the write-hold sweep
//! (`bench/src/bin/hold-sweep.rs`).

use hdrhistogram::Histogram;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{SimChannel, SimClock};
use crate::array::{new_latency_histogram, Array, ArrayCompletion, ArrayOp, ArrayRequest};
use crate::buf::AlignedBuf;
use crate::device::IoBuf;

/// What a job does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    /// Sequential writes of `block_bytes` from offset 0, wrapping at the end of the array.
    SeqWrite,
    /// Uniformly random aligned reads of `block_bytes`.
    RandRead,
}

/// One client job.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    /// What it does.
    pub kind: JobKind,
    /// Request size, bytes (a multiple of the array's block size).
    pub block_bytes: u32,
    /// Requests kept outstanding (queue depth).
    pub depth: u32,
    /// Active from this time, ns.
    pub start_ns: u64,
    /// Issues nothing new from this time, ns.
    pub stop_ns: u64,
    /// First byte of the region the job covers (a multiple of `block_bytes`).
    pub offset_bytes: u64,
    /// Bytes of the region, from `offset_bytes` (0: to the end of the array). A sequential
    /// writer wraps within it (a log on a large array: its pages are all the simulated
    /// members ever hold in memory for it).
    pub span_bytes: u64,
    /// Least time between two submissions of this job, ns (0: a free slot is refilled at
    /// once, several in one instant). Models a client whose requests reach the array one
    /// after another, spaced by the time the front end needs to receive each (an NBD
    /// client's 64 KiB payload takes ~55 µs on a 10 Gb/s link): the job still keeps at
    /// most `depth` outstanding.
    pub submit_gap_ns: u64,
}

/// What one job did.
pub struct JobStats {
    /// Completion latency of its requests (array submission → completion), ns.
    pub latency: Histogram<u64>,
    /// Requests completed.
    pub ops: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Time of its first issue and last completion, ns.
    pub first_ns: u64,
    /// Time of its last completion, ns.
    pub last_ns: u64,
}

struct Slot {
    buf: AlignedBuf,
    issued_ns: u64,
    busy: bool,
}

/// Runs `jobs` on `array` until `until_ns` (virtual), then drains what is outstanding.
/// Calls `sample(now_ns, array, stats)` every `sample_ns` (0: never).
///
/// # Panics
/// If a job's block size is zero or larger than the array, or the array refuses a
/// request as invalid (programmer errors in the scenario).
pub fn run(
    array: &mut Array<SimChannel>,
    clock: &SimClock,
    jobs: &[Job],
    until_ns: u64,
    seed: u64,
    sample_ns: u64,
    mut sample: impl FnMut(u64, &Array<SimChannel>, &[JobStats]),
) -> Vec<JobStats> {
    let capacity = array.geometry().capacity_bytes();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut slots: Vec<Vec<Slot>> = jobs
        .iter()
        .map(|j| {
            assert!(
                j.block_bytes > 0 && j.offset_bytes + u64::from(j.block_bytes) <= capacity,
                "job region inside the array"
            );
            (0..j.depth)
                .map(|_| Slot {
                    buf: AlignedBuf::zeroed(j.block_bytes as usize),
                    issued_ns: 0,
                    busy: false,
                })
                .collect()
        })
        .collect();
    let mut stats: Vec<JobStats> = jobs
        .iter()
        .map(|_| JobStats {
            latency: new_latency_histogram(),
            ops: 0,
            bytes: 0,
            errors: 0,
            first_ns: u64::MAX,
            last_ns: 0,
        })
        .collect();
    let mut cursor = vec![0u64; jobs.len()];
    // Earliest time of each job's next submission (its gap after the last one), ns.
    let mut next_submit = vec![0u64; jobs.len()];
    let mut out = [ArrayCompletion {
        tag: 0,
        status: Ok(()),
    }; 64];
    let mut next_sample = if sample_ns > 0 { sample_ns } else { u64::MAX };
    loop {
        let now = clock.now_ns();
        array.set_now(now);
        // Issue.
        let mut issued = false;
        for (j, job) in jobs.iter().enumerate() {
            if now < job.start_ns || now >= job.stop_ns || now >= until_ns {
                continue;
            }
            for (k, slot) in slots[j].iter_mut().enumerate() {
                if slot.busy {
                    continue;
                }
                if now < next_submit[j] {
                    break;
                }
                let rest = capacity.saturating_sub(job.offset_bytes);
                let span = if job.span_bytes == 0 {
                    rest
                } else {
                    job.span_bytes.min(rest)
                };
                let blocks = (span / u64::from(job.block_bytes)).max(1);
                let base = job.offset_bytes;
                let (op, off) = match job.kind {
                    JobKind::SeqWrite => {
                        let off = base + cursor[j] % blocks * u64::from(job.block_bytes);
                        cursor[j] += 1;
                        (ArrayOp::Write { fua: false }, off)
                    }
                    JobKind::RandRead => (
                        ArrayOp::Read,
                        base + rng.next_u64() % blocks * u64::from(job.block_bytes),
                    ),
                };
                // SAFETY: the slot's buffer lives in `slots` until this function returns,
                // after every request has completed (the drain below), and is not touched
                // while its request is outstanding (`busy`).
                let buf = unsafe { IoBuf::from_slice(&mut slot.buf) };
                let r = ArrayRequest {
                    tag: ((j as u64) << 32) | k as u64,
                    op,
                    offset_bytes: off,
                    len_bytes: job.block_bytes,
                    buf,
                };
                if array.submit(r).is_err() {
                    break;
                }
                slot.busy = true;
                slot.issued_ns = now;
                next_submit[j] = now + job.submit_gap_ns;
                stats[j].first_ns = stats[j].first_ns.min(now);
                issued = true;
            }
        }
        let progressed = array.process();
        let mut completed = false;
        loop {
            let n = array.poll(&mut out);
            for c in &out[..n] {
                let (j, k) = ((c.tag >> 32) as usize, (c.tag & 0xffff_ffff) as usize);
                let slot = &mut slots[j][k];
                assert!(slot.busy, "completion for an idle slot");
                slot.busy = false;
                let st = &mut stats[j];
                st.latency
                    .saturating_record(now.saturating_sub(slot.issued_ns).max(1));
                st.ops += 1;
                st.bytes += u64::from(jobs[j].block_bytes);
                st.errors += u64::from(c.status.is_err());
                st.last_ns = now;
                completed = true;
            }
            if n < out.len() {
                break;
            }
        }
        if now >= next_sample {
            sample(now, array, &stats);
            next_sample += sample_ns;
        }
        if issued || progressed || completed {
            continue;
        }
        // Nothing can happen now: jump to the next event.
        let outstanding = slots.iter().flatten().any(|s| s.busy);
        let mut next = array
            .channels()
            .filter_map(SimChannel::next_completion_ns)
            .min()
            .unwrap_or(u64::MAX);
        if let Some(d) = array.next_deadline_ns() {
            next = next.min(d);
        }
        for (j, job) in jobs.iter().enumerate() {
            for t in [job.start_ns, job.stop_ns] {
                if t > now && t < until_ns {
                    next = next.min(t);
                }
            }
            // The end of a gap is an event while the job has a free slot to fill then.
            let t = next_submit[j];
            if t > now && t < until_ns && t < job.stop_ns && slots[j].iter().any(|s| !s.busy) {
                next = next.min(t);
            }
        }
        if next_sample <= until_ns || outstanding {
            next = next.min(next_sample);
        }
        if next == u64::MAX || (next >= until_ns && !outstanding) {
            break;
        }
        clock.advance_to(next.max(now + 1));
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qos::DepthPolicy;
    use crate::sim::Profile;

    fn writes(gap_ns: u64, until_ns: u64) -> u64 {
        let (mut arr, clock) =
            crate::qos::tests::array(&Profile::fixed(1_000), DepthPolicy::Ferroraid);
        let job = Job {
            kind: JobKind::SeqWrite,
            block_bytes: 4096,
            depth: 8,
            start_ns: 0,
            stop_ns: until_ns,
            offset_bytes: 0,
            span_bytes: 0,
            submit_gap_ns: gap_ns,
        };
        let st = run(&mut arr, &clock, &[job], until_ns, 1, 0, |_, _, _| {});
        assert_eq!(st[0].errors, 0);
        st[0].ops
    }

    #[test]
    fn submit_gap_spaces_submissions() {
        // Virtual time: 10 ms, submissions at least 10 µs apart, members that take 1 µs.
        let (until, gap) = (10_000_000, 10_000);
        let spaced = writes(gap, until);
        assert!(
            spaced <= until / gap,
            "{spaced} writes in {until} ns, {gap} ns apart"
        );
        // The executor jumps to the end of each gap: the job keeps its rate.
        assert!(spaced >= until / gap * 9 / 10, "only {spaced} writes");
        // Without a gap the same job keeps its 8 slots full: many more writes.
        assert!(writes(0, until) > 2 * spaced);
    }
}
