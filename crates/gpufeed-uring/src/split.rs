//! How one requested range becomes engine reads: pieces of at most `block` bytes and, under
//! O_DIRECT, an unaligned head and tail (and a misaligned destination) through bounce buffers.

/// One engine read planned for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PartPlan {
    /// File offset of the kernel read (aligned under O_DIRECT).
    pub off: u64,
    /// Bytes the kernel is asked for.
    pub req: usize,
    /// Bytes that must arrive for the part to be complete (less than `req` only for a bounce
    /// read of the file's last block).
    pub want: usize,
    /// Where the kernel writes: the caller's memory, or `None` for a bounce buffer.
    pub dst: Option<usize>,
    /// For bounce reads: skip this many bytes of the bounce buffer, then copy `copy_len`
    /// bytes to `user_dst`.
    pub copy: Option<BounceCopy>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BounceCopy {
    pub skip: usize,
    pub copy_len: usize,
    pub user_dst: usize,
}

/// Plans the reads of `[offset, offset + len)` into memory at address `dst`.
///
/// `direct` is `(offset_align, mem_align)` for an O_DIRECT file; `block` is a multiple of
/// `offset_align`.
pub(crate) fn split(
    offset: u64,
    len: usize,
    dst: usize,
    direct: Option<(u32, u32)>,
    block: usize,
) -> Vec<PartPlan> {
    let mut parts = Vec::new();
    let end = offset + len as u64;
    let Some((a, m)) = direct else {
        let mut at = 0usize;
        while at < len {
            let n = (len - at).min(block);
            parts.push(PartPlan {
                off: offset + at as u64,
                req: n,
                want: n,
                dst: Some(dst + at),
                copy: None,
            });
            at += n;
        }
        return parts;
    };
    let (a, m) = (u64::from(a), m as usize);
    let bounce = |parts: &mut Vec<PartPlan>, from: u64, to: u64| {
        // One bounce read covering [from, to), which fits in one block.
        let start = from / a * a;
        let req = ((to - start).div_ceil(a) * a) as usize;
        parts.push(PartPlan {
            off: start,
            req,
            want: (to - start) as usize,
            dst: None,
            copy: Some(BounceCopy {
                skip: (from - start) as usize,
                copy_len: (to - from) as usize,
                user_dst: dst + (from - offset) as usize,
            }),
        });
    };
    let mid_start = offset.div_ceil(a) * a;
    let mid_end = end / a * a;
    if mid_start >= mid_end {
        // No whole aligned block inside: one or two bounce reads.
        let mut from = offset;
        while from < end {
            let to = end.min((from / a * a) + block as u64);
            bounce(&mut parts, from, to);
            from = to;
        }
        return parts;
    }
    if offset < mid_start {
        bounce(&mut parts, offset, mid_start);
    }
    let mid_dst = dst + (mid_start - offset) as usize;
    let mut at = mid_start;
    while at < mid_end {
        let n = (mid_end - at).min(block as u64);
        if mid_dst.is_multiple_of(m) {
            parts.push(PartPlan {
                off: at,
                req: n as usize,
                want: n as usize,
                dst: Some(dst + (at - offset) as usize),
                copy: None,
            });
        } else {
            bounce(&mut parts, at, at + n);
        }
        at += n;
    }
    if mid_end < end {
        bounce(&mut parts, mid_end, end);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every byte of the request is delivered exactly once, kernel reads obey the alignment,
    /// and no read exceeds the block.
    fn check(offset: u64, len: usize, dst: usize, direct: Option<(u32, u32)>, block: usize) {
        let parts = split(offset, len, dst, direct, block);
        let mut covered = vec![0u8; len];
        for p in &parts {
            assert!(p.req <= block && p.want <= p.req && p.want > 0, "{p:?}");
            let (user_from, n) = match (p.dst, p.copy) {
                (Some(d), None) => ((d - dst) as u64, p.req),
                (None, Some(c)) => {
                    assert!(c.skip + c.copy_len <= p.want, "{p:?}");
                    assert_eq!(p.off + c.skip as u64 - offset, (c.user_dst - dst) as u64);
                    ((c.user_dst - dst) as u64, c.copy_len)
                }
                _ => panic!("a part is either direct or bounced: {p:?}"),
            };
            if let Some((a, m)) = direct {
                assert_eq!(p.off % u64::from(a), 0, "{p:?}");
                assert_eq!(p.req % a as usize, 0, "{p:?}");
                if let Some(d) = p.dst {
                    assert_eq!(d % m as usize, 0, "{p:?}");
                }
            } else {
                assert_eq!(p.off - offset, user_from);
            }
            for b in &mut covered[user_from as usize..user_from as usize + n] {
                *b += 1;
            }
        }
        assert!(
            covered.iter().all(|&c| c == 1),
            "coverage {covered:?} of {parts:?}"
        );
    }

    #[test]
    fn examples() {
        check(0, 10_000, 4096, None, 4096);
        check(100, 10_000, 4096, Some((512, 512)), 4096);
        check(512, 1024, 4096, Some((512, 512)), 4096);
        check(513, 10, 4096, Some((512, 512)), 4096);
        check(511, 2, 4096, Some((512, 512)), 4096); // straddles one boundary
        check(0, 8192, 4097, Some((4096, 4096)), 8192); // misaligned destination
        let aligned = split(4096, 8192, 8192, Some((4096, 4096)), 4096);
        assert!(
            aligned.iter().all(|p| p.copy.is_none()),
            "aligned requests need no bounce"
        );
    }

    proptest! {
        #[test]
        fn every_byte_once(
            offset in 0u64..100_000,
            len in 1usize..100_000,
            dst in 0usize..10_000,
            direct in prop_oneof![Just(None), Just(Some((512u32, 512u32))), Just(Some((4096, 512))), Just(Some((4096, 4096)))],
            blocks in 1usize..5,
        ) {
            let a = direct.map_or(1, |(a, _)| a as usize);
            check(offset, len, dst, direct, blocks * a.max(4096));
        }
    }
}
