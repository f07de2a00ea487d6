//! `null`: a device that stores nothing. Every valid request completes successfully at the
//! next `poll` without touching its buffer (reads leave the buffer as it was), so the cost
//! measured through it is the engine's own.

use engine::device::{
    validate_gather, BlockDevice, Channel, Completion, DeviceError, DeviceInfo, Request,
    SubmitError,
};

use crate::mem::{memory_device_info, Immediate};

/// A block device without data.
pub struct NullDevice {
    info: DeviceInfo,
}

impl NullDevice {
    /// A null device of `capacity_bytes` with `block_bytes` logical blocks and
    /// `queue_depth` requests per channel.
    ///
    /// # Errors
    /// [`DeviceError::Unusable`] for a block size other than 512/4096, a capacity that is
    /// zero or not a multiple of the block size, or a zero queue depth.
    pub fn new(
        name: &str,
        capacity_bytes: u64,
        block_bytes: u32,
        queue_depth: u32,
    ) -> Result<Self, DeviceError> {
        Ok(Self {
            info: memory_device_info(name, capacity_bytes, block_bytes, queue_depth)?,
        })
    }
}

impl BlockDevice for NullDevice {
    type Channel = NullChannel;

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn open_channel(&self) -> Result<NullChannel, DeviceError> {
        Ok(NullChannel {
            info: self.info.clone(),
            done: Immediate::new(self.info.queue_depth),
        })
    }
}

/// A channel of a [`NullDevice`].
pub struct NullChannel {
    info: DeviceInfo,
    done: Immediate,
}

impl Channel for NullChannel {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        validate_gather(&self.info, &req)?;
        self.done.admit()?;
        self.done.complete(req.tag);
        Ok(())
    }

    /// Gathered writes go nowhere, like every other write.
    fn gathers(&self) -> bool {
        true
    }

    fn kick(&mut self) {}

    fn poll(&mut self, out: &mut [Completion]) -> usize {
        self.done.poll(out)
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::device::{IoBuf, Op};

    #[test]
    fn completes_valid_requests_and_refuses_bad_ones() {
        let dev = NullDevice::new("null0", 1 << 30, 4096, 3).unwrap();
        let mut ch = dev.open_channel().unwrap();
        let flush = Request {
            tag: 9,
            op: Op::Flush,
            offset_bytes: 0,
            len_bytes: 0,
            buf: IoBuf::NONE,
        };
        let zero = |off| Request {
            tag: off,
            op: Op::WriteZeroes,
            offset_bytes: off,
            len_bytes: 4096,
            buf: IoBuf::NONE,
        };
        ch.submit(flush).unwrap();
        ch.submit(zero(4096)).unwrap();
        assert!(matches!(ch.submit(zero(100)), Err(SubmitError::Invalid(_))));
        assert!(matches!(
            ch.submit(zero(1 << 30)),
            Err(SubmitError::Invalid(_))
        ));
        assert_eq!(ch.in_flight(), 2);
        let mut out = [Completion::EMPTY; 1];
        assert_eq!(ch.poll(&mut out), 1);
        assert_eq!(out[0].tag, 9);
        assert_eq!(ch.poll(&mut out), 1);
        assert_eq!(ch.poll(&mut out), 0);
    }
}
