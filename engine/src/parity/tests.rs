//! Every kernel against the scalar reference, the reference against the definition, and
//! every recovery case against the original bytes.

use proptest::prelude::*;

use super::*;
use crate::buf::AlignedBuf;

/// Deterministic pseudo-random fill (ChaCha8 from `seed`), so a failing proptest case
/// replays from its printed seed without storing megabytes of input.
fn fill(buf: &mut [u8], seed: u64) {
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    rand_chacha::ChaCha8Rng::seed_from_u64(seed).fill_bytes(buf);
}

fn chunks(n: usize, len: usize, seed: u64) -> Vec<AlignedBuf> {
    (0..n)
        .map(|i| {
            let mut b = AlignedBuf::zeroed(len);
            fill(
                &mut b,
                seed ^ (i as u64).wrapping_mul(0x1234_5678_9abc_def1),
            );
            b
        })
        .collect()
}

fn refs(v: &[AlignedBuf]) -> Vec<&[u8]> {
    v.iter().map(|b| &b[..]).collect()
}

/// P and Q straight from the definition, byte by byte (no Horner, no kernels).
fn definition(data: &[&[u8]]) -> (Vec<u8>, Vec<u8>) {
    let len = data[0].len();
    let mut p = vec![0u8; len];
    let mut q = vec![0u8; len];
    for (i, d) in data.iter().enumerate() {
        let c = gf_pow_g(i as u32);
        for j in 0..len {
            p[j] ^= d[j];
            q[j] ^= gf_mul(c, d[j]);
        }
    }
    (p, q)
}

fn kernels() -> Vec<Parity> {
    Kernel::available()
        .flat_map(|k| {
            let p = Parity::with_kernel(k).unwrap();
            [p.streaming(true), p.streaming(false)]
        })
        .collect()
}

#[test]
fn simd_kernels_present_on_this_machine() {
    // The CI machine has AVX-512BW and GFNI; make sure they are exercised, not skipped.
    if std::env::var_os("FERRORAID_EXPECT_GFNI").is_some() {
        assert!(Kernel::Avx512Gfni.is_available());
        assert!(Kernel::Avx2.is_available());
    }
    assert!(Kernel::available().count() >= 1);
    assert_eq!(Kernel::best(), Kernel::available().last().unwrap());
}

#[test]
fn scalar_matches_definition_up_to_255_chunks() {
    let s = Parity::with_kernel(Kernel::Scalar).unwrap();
    for n in [1usize, 2, 3, 17, 254, 255] {
        let data = chunks(n, 128, n as u64);
        let r = refs(&data);
        let (ep, eq) = definition(&r);
        let mut p = AlignedBuf::zeroed(128);
        let mut q = AlignedBuf::zeroed(128);
        s.gen_pq(&r, &mut p, &mut q);
        assert_eq!(&p[..], &ep[..]);
        assert_eq!(&q[..], &eq[..]);
    }
}

#[test]
fn unavailable_or_unknown_kernel_is_an_error() {
    assert_eq!("avx512-gfni".parse::<Kernel>().unwrap(), Kernel::Avx512Gfni);
    let e = "sse9".parse::<Kernel>().unwrap_err();
    assert!(e.to_string().contains("avx512-gfni"));
    for k in Kernel::ALL {
        assert_eq!(Parity::with_kernel(k).is_ok(), k.is_available());
    }
}

#[test]
#[should_panic(expected = "aligned")]
fn misaligned_buffer_is_refused() {
    let data = chunks(3, 256, 1);
    let mut p = AlignedBuf::zeroed(256 + 64);
    Parity::new().gen_p(&refs(&data), &mut p[1..257]);
}

#[test]
#[should_panic(expected = "multiple of 64")]
fn odd_length_is_refused() {
    let data = [AlignedBuf::zeroed(100), AlignedBuf::zeroed(100)];
    let mut p = AlignedBuf::zeroed(100);
    Parity::new().gen_p(&refs(&data), &mut p);
}

#[test]
fn too_many_erasures_and_bad_ids_are_errors() {
    let par = Parity::new();
    let mut data = chunks(4, 64, 7);
    let mut p = AlignedBuf::zeroed(64);
    let mut q = AlignedBuf::zeroed(64);
    let before: Vec<Vec<u8>> = data.iter().map(|b| b.to_vec()).collect();
    let mut dm: Vec<&mut [u8]> = data.iter_mut().map(|b| &mut b[..]).collect();
    let e = par
        .reconstruct(
            &mut dm,
            &mut p,
            Some(&mut q),
            &[ChunkId::Data(0), ChunkId::P, ChunkId::Q],
        )
        .unwrap_err();
    assert_eq!(
        e,
        ParityError::TooManyErasures {
            lost: 3,
            redundancy: 2
        }
    );
    let e = par
        .reconstruct(&mut dm, &mut p, None, &[ChunkId::Data(0), ChunkId::Data(1)])
        .unwrap_err();
    assert!(e.to_string().contains("only 1 parity"), "{e}");
    assert_eq!(
        par.reconstruct(&mut dm, &mut p, None, &[ChunkId::Q]),
        Err(ParityError::NoSuchChunk(ChunkId::Q))
    );
    assert_eq!(
        par.reconstruct(&mut dm, &mut p, None, &[ChunkId::Data(4)]),
        Err(ParityError::NoSuchChunk(ChunkId::Data(4)))
    );
    // Duplicates count once.
    par.reconstruct(&mut dm, &mut p, None, &[ChunkId::P, ChunkId::P])
        .unwrap();
    // Nothing was written by the refused calls.
    for (b, d) in before.iter().zip(&dm) {
        assert_eq!(&b[..], &d[..]);
    }
}

/// Every erasure pattern a RAID6 (resp. RAID5) stripe survives.
fn erasure_patterns(nd: usize, raid6: bool) -> Vec<Vec<ChunkId>> {
    let mut ids: Vec<ChunkId> = (0..nd as u8).map(ChunkId::Data).collect();
    ids.push(ChunkId::P);
    if raid6 {
        ids.push(ChunkId::Q);
    }
    let mut out = vec![vec![]];
    for (i, a) in ids.iter().enumerate() {
        out.push(vec![*a]);
        if raid6 {
            for b in &ids[i + 1..] {
                out.push(vec![*a, *b]);
            }
        }
    }
    out
}

fn check_all_recoveries(par: &Parity, nd: usize, len: usize, seed: u64, raid6: bool) {
    let data = chunks(nd, len, seed);
    let r = refs(&data);
    let (ep, eq) = definition(&r);
    for lost in erasure_patterns(nd, raid6) {
        let mut work: Vec<AlignedBuf> = data.clone();
        let mut p = AlignedBuf::from_slice(&ep);
        let mut q = AlignedBuf::from_slice(&eq);
        // Poison what is lost so a no-op "recovery" cannot pass.
        for c in &lost {
            match c {
                ChunkId::Data(s) => fill(&mut work[*s as usize], !seed),
                ChunkId::P => fill(&mut p, !seed ^ 1),
                ChunkId::Q => fill(&mut q, !seed ^ 2),
            }
        }
        let mut dm: Vec<&mut [u8]> = work.iter_mut().map(|b| &mut b[..]).collect();
        let qarg = if raid6 { Some(&mut q[..]) } else { None };
        par.reconstruct(&mut dm, &mut p, qarg, &lost)
            .unwrap_or_else(|e| panic!("{lost:?}: {e}"));
        for (i, (w, d)) in work.iter().zip(&data).enumerate() {
            assert!(
                w[..] == d[..],
                "{} lost {lost:?}: data slot {i} differs",
                par.kernel()
            );
        }
        assert!(p[..] == ep[..], "{} lost {lost:?}: P differs", par.kernel());
        if raid6 {
            assert!(q[..] == eq[..], "{} lost {lost:?}: Q differs", par.kernel());
        }
    }
}

#[test]
fn all_recoveries_with_wide_stripes() {
    for par in kernels() {
        for nd in [2usize, 3, 254, 255] {
            check_all_recoveries(&par, nd, 64, nd as u64, true);
        }
        // The widest RAID5 stripe (256 members) too.
        check_all_recoveries(&par, 255, 64, 7, false);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// gen_p / gen_q / gen_pq of every kernel equal the scalar reference.
    #[test]
    fn generation_matches_reference(nd in 1usize..=24, units in 1usize..=70, seed in any::<u64>()) {
        let len = units * ALIGN;
        let data = chunks(nd, len, seed);
        let r = refs(&data);
        let scalar = Parity::with_kernel(Kernel::Scalar).unwrap();
        let mut sp = AlignedBuf::zeroed(len);
        let mut sq = AlignedBuf::zeroed(len);
        scalar.gen_pq(&r, &mut sp, &mut sq);
        for par in kernels() {
            let mut p = AlignedBuf::zeroed(len);
            let mut q = AlignedBuf::zeroed(len);
            par.gen_pq(&r, &mut p, &mut q);
            prop_assert!(p[..] == sp[..], "{} P", par.kernel());
            prop_assert!(q[..] == sq[..], "{} Q", par.kernel());
            let mut p1 = AlignedBuf::zeroed(len);
            par.gen_p(&r, &mut p1);
            prop_assert!(p1[..] == sp[..], "{} P-only", par.kernel());
            let mut q1 = AlignedBuf::zeroed(len);
            par.gen_q(&r, &mut q1);
            prop_assert!(q1[..] == sq[..], "{} Q-only", par.kernel());
        }
    }

    /// Read-modify-write updates equal a full regeneration, for every kernel.
    #[test]
    fn rmw_matches_regeneration(
        nd in 2usize..=20,
        units in 1usize..=40,
        seed in any::<u64>(),
        changed in proptest::collection::btree_set(0usize..20, 1..6),
    ) {
        let len = units * ALIGN;
        let old = chunks(nd, len, seed);
        let mut new = old.clone();
        let changed: Vec<usize> = changed.into_iter().filter(|&c| c < nd).collect();
        prop_assume!(!changed.is_empty());
        for &c in &changed {
            fill(&mut new[c], seed.rotate_left(c as u32 + 1));
        }
        let (op, oq) = definition(&refs(&old));
        let (np, nq) = definition(&refs(&new));
        for par in kernels() {
            let deltas: Vec<Delta> = changed
                .iter()
                .map(|&c| Delta { slot: c as u8, old: &old[c], new: &new[c] })
                .collect();
            let mut p = AlignedBuf::from_slice(&op);
            let mut q = AlignedBuf::from_slice(&oq);
            par.update_pq(&deltas, &mut p, &mut q);
            prop_assert!(p[..] == np[..], "{} P", par.kernel());
            prop_assert!(q[..] == nq[..], "{} Q", par.kernel());
            let mut p = AlignedBuf::from_slice(&op);
            par.update_p(&deltas, &mut p);
            prop_assert!(p[..] == np[..], "{} P-only", par.kernel());
        }
    }

    /// Partial Q (`fold_q` of a stripe's Q and some of its chunks) is the Q syndrome, by
    /// the definition, of the stripe with those chunks zeroed, for every kernel and both
    /// store policies.
    #[test]
    fn fold_q_is_the_syndrome_of_the_other_chunks(
        nd in 2usize..=20,
        units in 1usize..=40,
        seed in any::<u64>(),
        folded in proptest::collection::btree_set(0usize..20, 0..6),
    ) {
        let len = units * ALIGN;
        let data = chunks(nd, len, seed);
        let folded: Vec<usize> = folded.into_iter().filter(|&c| c < nd).collect();
        let (_, q) = definition(&refs(&data));
        let mut rest = data.clone();
        for &c in &folded {
            rest[c].fill(0);
        }
        let (_, want) = definition(&refs(&rest));
        for par in kernels() {
            let srcs: Vec<(u8, &[u8])> = folded.iter().map(|&c| (c as u8, &data[c][..])).collect();
            let q_in = AlignedBuf::from_slice(&q);
            let mut out = AlignedBuf::zeroed(len);
            par.fold_q(&srcs, &q_in, &mut out);
            prop_assert!(out[..] == want[..], "{} partial Q", par.kernel());
        }
    }

    /// Every one- and two-erasure case of RAID6 and every one-erasure case of RAID5
    /// restores the exact bytes, for every kernel.
    #[test]
    fn every_recovery_restores_bytes(nd in 2usize..=12, units in 1usize..=12, seed in any::<u64>()) {
        let len = units * ALIGN;
        for par in kernels() {
            check_all_recoveries(&par, nd, len, seed, true);
            check_all_recoveries(&par, nd, len, seed, false);
        }
    }
}

/// `copy` is a copy on every kernel and store policy: lengths of none, one unit, one
/// unrolled step and a tail, into a destination holding other bytes, with nothing written
/// past its end.
#[test]
fn copy_copies_on_every_kernel() {
    for par in kernels() {
        for len in [0usize, 64, 256, 4096 + 192, 64 << 10] {
            let src = chunks(1, len.max(64), len as u64);
            let mut dst = chunks(1, len + 256, !(len as u64));
            let tail = dst[0][len..].to_vec();
            par.copy(&src[0][..len], &mut dst[0][..len]);
            assert_eq!(
                &dst[0][..len],
                &src[0][..len],
                "{:?} len {len}",
                par.kernel()
            );
            assert_eq!(
                &dst[0][len..],
                &tail[..],
                "{:?} len {len}: overrun",
                par.kernel()
            );
        }
    }
}
