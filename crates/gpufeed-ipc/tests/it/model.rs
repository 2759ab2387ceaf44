//! The ring against a `VecDeque` model, driven by proptest (one process, every operation).

use std::collections::VecDeque;

use gpufeed_ipc::BatchRing;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Publish(Vec<u8>),
    Abort,
    Take,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..600).prop_map(Op::Publish),
        Just(Op::Abort),
        Just(Op::Take),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn ring_behaves_like_a_bounded_fifo(ops in proptest::collection::vec(op(), 1..80)) {
        let ring = BatchRing::anonymous(4, 512).expect("ring");
        let consumer = ring.consumer().expect("consumer");
        let mut model: VecDeque<Vec<u8>> = VecDeque::new();
        for op in ops {
            match op {
                Op::Publish(data) => match ring.try_claim().expect("try_claim") {
                    None => prop_assert_eq!(model.len(), 4, "no free slot while the model has room"),
                    Some(mut claim) => {
                        prop_assert!(model.len() < 4, "claimed a slot beyond capacity");
                        if data.len() as u64 > claim.capacity() {
                            prop_assert!(claim.write_at(0, &data).is_err());
                            continue; // dropped unpublished
                        }
                        claim.write_at(0, &data).expect("write");
                        claim.set_len(data.len() as u64).expect("len");
                        claim.publish().expect("publish");
                        model.push_back(data);
                    }
                },
                Op::Abort => {
                    if let Some(claim) = ring.try_claim().expect("try_claim") {
                        drop(claim);
                    }
                }
                Op::Take => match consumer.try_next().expect("attached") {
                    None => prop_assert!(model.is_empty()),
                    Some(batch) => {
                        let want = model.pop_front();
                        prop_assert_eq!(Some(batch.to_vec()), want, "out of order or changed");
                    }
                },
            }
            let stats = ring.stats();
            prop_assert_eq!(stats.ready as usize, model.len());
            prop_assert_eq!((stats.claimed, stats.taken), (0, 0));
        }
    }
}
