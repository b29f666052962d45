//! Multi-process tests of `braid_runtime::dist` on Gloo, through the harness in `ranks/`
//! (children of this test binary on 127.0.0.1, every wait bounded, every child killed by pid).

mod ranks;

use std::time::{Duration, Instant};

use ranks::{READY, Ranks, child_rank, free_port, serial, world_group};

use braid_runtime::dist::{DistError, GroupOptions, ProcessGroup, ReduceOp, Store, World};
use tch::{Kind, Tensor};

fn i64s(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(t.flatten(0, -1)).expect("i64 tensor")
}

fn f64s(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.flatten(0, -1)).expect("f64 tensor")
}

fn assert_invalid(result: braid_runtime::dist::Result<()>, needle: &str) {
    match result {
        Err(DistError::Invalid(message)) => {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}")
        }
        other => panic!("expected Invalid({needle:?}), got {other:?}"),
    }
}

#[test]
fn collectives_are_exact_on_three_ranks() {
    if let Some(rank) = child_rank() {
        return collectives_rank(rank);
    }
    let _serial = serial();
    let mut ranks = Ranks::spawn("collectives_are_exact_on_three_ranks", 3, &[]);
    ranks.expect_all_success(Duration::from_secs(60));
}

fn collectives_rank(rank: usize) {
    let g = world_group(Duration::from_secs(10), Duration::from_millis(100));
    assert_eq!((g.rank(), g.size()), (rank, 3));
    let r = rank as i64;

    let mut t = Tensor::from_slice(&[r + 1, 10 * (r + 1)]);
    g.all_reduce(&mut t, ReduceOp::Sum).expect("sum");
    assert_eq!(i64s(&t), [6, 60]);

    let mut t = Tensor::from_slice(&[r as f64, -(r as f64)]);
    g.all_reduce(&mut t, ReduceOp::Max).expect("max");
    assert_eq!(f64s(&t), [2.0, 0.0]);
    let mut t = Tensor::from_slice(&[r as f64, -(r as f64)]);
    g.all_reduce(&mut t, ReduceOp::Min).expect("min");
    assert_eq!(f64s(&t), [0.0, -2.0]);
    let mut t = Tensor::from_slice(&[[1.0, 2.0, 4.0][rank]]);
    g.all_reduce(&mut t, ReduceOp::Avg).expect("avg");
    assert_eq!(f64s(&t), [7.0 / 3.0]);

    // A bucket of gradients of different shapes, one collective.
    let mut bucket = vec![
        Tensor::full([2, 2], r as f64, (Kind::Double, tch::Device::Cpu)),
        Tensor::from_slice(&[r as f64, 1.0, 2.0 * r as f64]),
    ];
    g.all_reduce_coalesced(&mut bucket, ReduceOp::Sum)
        .expect("coalesced");
    assert_eq!(f64s(&bucket[0]), [3.0; 4]);
    assert_eq!(bucket[0].size(), [2, 2]);
    assert_eq!(f64s(&bucket[1]), [3.0, 3.0, 6.0]);

    let mut t = if rank == 1 {
        Tensor::from_slice(&[7i64, 8, 9])
    } else {
        Tensor::zeros([3], (Kind::Int64, tch::Device::Cpu))
    };
    g.broadcast(&mut t, 1).expect("broadcast");
    assert_eq!(i64s(&t), [7, 8, 9]);

    let input = Tensor::from_slice(&[r, 10 * r]);
    let mut output = Tensor::zeros([6], (Kind::Int64, tch::Device::Cpu));
    g.all_gather(&mut output, &input).expect("all_gather");
    assert_eq!(i64s(&output), [0, 0, 1, 10, 2, 20]);

    // The runtime's exchange of byte messages: one all-gather where every message fits in
    // its first, a second for the rest of a longer one; empty messages too.
    let cap = braid_cost::cost::exchange_inline_bytes(3);
    for sizes in [
        [0, 0, 0],
        [0, 5, cap],
        [cap, cap + 1, 3],
        [100_000, 0, 2 * cap + 7],
    ] {
        let message =
            |of: usize| -> Vec<u8> { (0..sizes[of]).map(|i| (i * 31 + of * 7) as u8).collect() };
        let got = braid_runtime::exec::all_gather_bytes(&g, message(rank)).expect("exchange");
        assert_eq!(got, (0..3).map(message).collect::<Vec<_>>(), "{sizes:?}");
    }

    let input = Tensor::arange(6, (Kind::Int64, tch::Device::Cpu)) + 100 * r;
    let mut output = Tensor::zeros([2], (Kind::Int64, tch::Device::Cpu));
    g.reduce_scatter(&mut output, &input, ReduceOp::Sum)
        .expect("reduce_scatter");
    let block = 2 * r;
    assert_eq!(i64s(&output), [3 * block + 300, 3 * (block + 1) + 300]);

    // Point to point, with tags telling two messages from rank 0 apart.
    match rank {
        0 => {
            g.send(&Tensor::from_slice(&[1i64, 2, 3]), 1, 11)
                .expect("send to 1");
            g.send(&Tensor::from_slice(&[4i64, 5]), 2, 12)
                .expect("send to 2");
            let mut back = Tensor::zeros([2, 2], (Kind::Double, tch::Device::Cpu));
            g.recv(&mut back, 2, 13).expect("recv from 2");
            assert_eq!(f64s(&back), [0.5, 1.5, 2.5, 3.5]);
        }
        1 => {
            let mut t = Tensor::zeros([3], (Kind::Int64, tch::Device::Cpu));
            g.recv(&mut t, 0, 11).expect("recv from 0");
            assert_eq!(i64s(&t), [1, 2, 3]);
        }
        _ => {
            let mut t = Tensor::zeros([2], (Kind::Int64, tch::Device::Cpu));
            g.recv(&mut t, 0, 12).expect("recv from 0");
            assert_eq!(i64s(&t), [4, 5]);
            let back = Tensor::from_slice(&[0.5f64, 1.5, 2.5, 3.5]).reshape([2, 2]);
            g.send(&back, 0, 13).expect("send to 0");
        }
    }

    // Mistakes every rank makes alike are refused before anything is sent...
    let mut t = Tensor::zeros([1], (Kind::Int64, tch::Device::Cpu));
    assert_invalid(g.broadcast(&mut t, 3), "broadcast root 3 is not a rank");
    assert_invalid(g.send(&t, rank, 0), "cannot send to itself");
    assert_invalid(g.send(&t, (rank + 1) % 3, u32::MAX), "largest tag");
    assert_invalid(g.all_reduce(&mut t, ReduceOp::Avg), "floating-point");
    let mut short = Tensor::zeros([5], (Kind::Int64, tch::Device::Cpu));
    assert_invalid(
        g.all_gather(&mut short, &Tensor::from_slice(&[r, r])),
        "5 elements is not 3 blocks of 2",
    );
    // ...and leave the group usable.
    g.barrier().expect("barrier");
    let mut t = Tensor::from_slice(&[1i64]);
    g.all_reduce(&mut t, ReduceOp::Sum)
        .expect("sum after refusals");
    assert_eq!(i64s(&t), [3]);
    g.shutdown().expect("shutdown");
}

#[test]
fn subgroups_over_subsets_of_four_ranks() {
    if let Some(rank) = child_rank() {
        return subgroups_rank(rank);
    }
    let _serial = serial();
    let mut ranks = Ranks::spawn("subgroups_over_subsets_of_four_ranks", 4, &[]);
    ranks.expect_all_success(Duration::from_secs(60));
}

fn subgroups_rank(rank: usize) {
    let world = world_group(Duration::from_secs(10), Duration::from_millis(100));
    let r = rank as i64;

    // {0,1} and {2,3} at once, each created by its members only.
    let pair: &[usize] = if rank < 2 { &[0, 1] } else { &[2, 3] };
    let g = world.subgroup(pair).expect("pair group");
    assert_eq!((g.rank(), g.size(), g.global_ranks()), (rank % 2, 2, pair));
    let mut t = Tensor::from_slice(&[r + 1]);
    g.all_reduce(&mut t, ReduceOp::Sum).expect("pair sum");
    assert_eq!(i64s(&t), [if rank < 2 { 3 } else { 7 }]);

    // {1,3}, given out of order; 0 and 2 are not members and may not create it.
    if rank == 1 || rank == 3 {
        let odd = world.subgroup(&[3, 1]).expect("odd group");
        assert_eq!(
            (odd.rank(), odd.global_ranks()),
            (rank / 2, &[1usize, 3][..])
        );
        let mut t = Tensor::from_slice(&[r]);
        odd.all_reduce(&mut t, ReduceOp::Sum).expect("odd sum");
        assert_eq!(i64s(&t), [4]);
        let mut t = Tensor::from_slice(&[r * 100]);
        odd.broadcast(&mut t, 1)
            .expect("odd broadcast from global rank 3");
        assert_eq!(i64s(&t), [300]);
    } else {
        match world.subgroup(&[1, 3]) {
            Err(DistError::Invalid(m)) => assert!(m.contains("only members"), "{m}"),
            other => panic!("a non-member created a group: {other:?}"),
        }
    }

    // The same members again: a second group with a key space of its own.
    let again = world.subgroup(pair).expect("second pair group");
    let mut t = Tensor::from_slice(&[10 * r]);
    again
        .all_reduce(&mut t, ReduceOp::Max)
        .expect("second pair max");
    assert_eq!(i64s(&t), [if rank < 2 { 10 } else { 30 }]);

    // The world is unaffected.
    let mut t = Tensor::from_slice(&[r]);
    world.all_reduce(&mut t, ReduceOp::Sum).expect("world sum");
    assert_eq!(i64s(&t), [6]);
    match g.shutdown() {
        Err(DistError::Invalid(m)) => assert!(m.contains("world group"), "{m}"),
        other => panic!("a sub-group shut down: {other:?}"),
    }
    world.shutdown().expect("world shutdown");
}

/// What the disturbed-rank tests measure: a survivor's error arrives, and names the victim.
const KILL_TIMEOUT: Duration = Duration::from_secs(4);
const KILL_HEARTBEAT: Duration = Duration::from_millis(100);

/// Survivors loop on all-reduces until one fails, and check whom the error blames.
fn survivor_or_victim(rank: usize) {
    let victim: usize = std::env::var("BRAID_DIST_TEST_VICTIM")
        .expect("victim")
        .parse()
        .expect("victim rank");
    let g = world_group(KILL_TIMEOUT, KILL_HEARTBEAT);
    g.barrier().expect("barrier before the loop");
    println!("{READY}");
    let mut t = Tensor::ones([1 << 14], (Kind::Float, tch::Device::Cpu));
    for _ in 0..1_000_000 {
        let Err(error) = g.all_reduce(&mut t, ReduceOp::Max) else {
            continue;
        };
        assert_ne!(rank, victim, "the victim itself failed: {error}");
        println!("rank {rank} error: {error}");
        assert_eq!(error.dead_ranks(), [victim], "{error}");
        assert!(
            error.to_string().contains(&format!("rank {victim}")),
            "{error}"
        );
        // The group is spent: a second call says so at once.
        match g.barrier() {
            Err(DistError::Broken { .. }) => {}
            other => panic!("a failed group was used again: {other:?}"),
        }
        // Rank 0 hosts the store the others diagnose through: every survivor stays until the
        // parent has seen all of them report, so none is blamed for another's exit.
        let release = std::env::var("BRAID_DIST_TEST_RELEASE").expect("release file");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::path::Path::new(&release).exists() {
            assert!(Instant::now() < deadline, "rank {rank}: never released");
            std::thread::sleep(Duration::from_millis(10));
        }
        return;
    }
    panic!("rank {rank}: a million all-reduces and no failure");
}

/// Spawns `n` ranks, disturbs `victim` once all are looping (SIGKILL, or SIGSTOP when `kill`
/// is false), and checks that the others return an error naming it: within the timeout when
/// it was killed, at the timeout plus the diagnosis when it was stopped.
fn disturb(test: &str, n: usize, victim: usize, kill: bool) {
    let _serial = serial();
    let release = std::env::temp_dir().join(format!("braid-dist-release-{}", std::process::id()));
    let _ = std::fs::remove_file(&release);
    let mut ranks = Ranks::spawn(
        test,
        n,
        &[
            ("BRAID_DIST_TEST_VICTIM", victim.to_string()),
            ("BRAID_DIST_TEST_RELEASE", release.display().to_string()),
        ],
    );
    let all: Vec<usize> = (0..n).collect();
    ranks.wait_ready(&all, Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(200));
    let disturbed = Instant::now();
    if kill {
        ranks.kill(victim);
    } else {
        ranks.stop(victim);
    }
    let survivors: Vec<usize> = all.iter().copied().filter(|&r| r != victim).collect();
    let diagnosis = KILL_HEARTBEAT * 3;
    let within = KILL_TIMEOUT + diagnosis + Duration::from_secs(10);
    let reported: Vec<String> = survivors
        .iter()
        .map(|r| format!("rank {r} error:"))
        .collect();
    let seen = ranks.wait_printed(&survivors, &reported, within);
    let first = seen.iter().min().copied().expect("survivors") - disturbed;
    let took = seen.iter().max().copied().expect("survivors") - disturbed;
    std::fs::write(&release, b"").expect("write the release file");
    ranks.expect_success(&survivors, within);
    let _ = std::fs::remove_file(&release);
    if kill {
        // Closed sockets are noticed at once: a rank the victim's sockets served fails well
        // within the timeout. A survivor waiting on another survivor (which stays, see
        // `survivor_or_victim`, rather than exit and close its sockets) learns by the timeout;
        // every survivor reports within it and the diagnosis.
        assert!(first < KILL_TIMEOUT, "{first:?}:\n{}", ranks.all_output());
        assert!(
            took < KILL_TIMEOUT + diagnosis + Duration::from_secs(3),
            "{took:?}:\n{}",
            ranks.all_output()
        );
    } else {
        // A stopped peer is only noticed by the timeout (less the part of the operation that
        // ran before the stop), then the diagnosis; 3 s of slack for exiting on a busy machine.
        assert!(
            took >= KILL_TIMEOUT - Duration::from_millis(500)
                && took < KILL_TIMEOUT + diagnosis + Duration::from_secs(3),
            "{took:?}:\n{}",
            ranks.all_output()
        );
    }
    for &r in &survivors {
        let out = ranks.output(r);
        let line = format!("rank {r} error:");
        let Some(error) = out.lines().find(|l| l.starts_with(&line)) else {
            panic!("rank {r} printed no error:\n{out}");
        };
        eprintln!("{error}");
    }
    eprintln!("the survivors of rank {victim} returned {took:?} after it was disturbed");
}

#[test]
fn a_killed_rank_is_named_by_the_others_within_the_timeout() {
    if let Some(rank) = child_rank() {
        return survivor_or_victim(rank);
    }
    disturb(
        "a_killed_rank_is_named_by_the_others_within_the_timeout",
        3,
        2,
        true,
    );
}

#[test]
fn a_killed_store_host_is_named_as_rank_0() {
    if let Some(rank) = child_rank() {
        return survivor_or_victim(rank);
    }
    disturb("a_killed_store_host_is_named_as_rank_0", 3, 0, true);
}

#[test]
fn a_stopped_rank_times_out_and_is_named() {
    if let Some(rank) = child_rank() {
        return survivor_or_victim(rank);
    }
    disturb("a_stopped_rank_times_out_and_is_named", 3, 1, false);
}

#[test]
fn store_set_get_add_prefix_and_timeouts() {
    if child_rank().is_some() {
        return;
    }
    let _serial = serial();
    let port = free_port();
    let store = Store::tcp("127.0.0.1", port, 0, 1, Duration::from_secs(5)).expect("host a store");
    store.set("k", b"value").expect("set");
    assert_eq!(
        store.get("k", Duration::from_secs(1)).expect("get"),
        b"value"
    );
    store.set("empty", b"").expect("set empty");
    assert_eq!(
        store
            .get("empty", Duration::from_secs(1))
            .expect("get empty"),
        b""
    );
    assert_eq!(store.add("n", 5).expect("add"), 5);
    assert_eq!(store.add("n", -2).expect("add"), 3);
    assert_eq!(store.add("n", 0).expect("read"), 3);

    // A prefix view sees only its own keys; the base sees them under the prefix.
    let view = store.prefixed("pg7").expect("prefix");
    view.set("k", b"inner").expect("set in view");
    assert_eq!(
        store.get("pg7/k", Duration::from_secs(1)).expect("get"),
        b"inner"
    );
    assert_eq!(
        view.get("k", Duration::from_secs(1)).expect("get"),
        b"inner"
    );
    // Another connection sees the same store.
    let other = store.reconnect().expect("reconnect");
    assert_eq!(
        other.get("k", Duration::from_secs(1)).expect("get"),
        b"value"
    );
    view.wait(&["k"], Duration::from_secs(1))
        .expect("wait for a set key");

    // Waiting for a key nobody sets ends at the timeout, with an error naming the key.
    let start = Instant::now();
    let error = view
        .get("missing", Duration::from_millis(300))
        .expect_err("a missing key times out");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("\"missing\"") && message.contains("pg7"),
        "{message}"
    );
    let start = Instant::now();
    let error = store
        .wait(&["k", "never"], Duration::from_millis(200))
        .expect_err("wait times out");
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(error.to_string().contains("never"), "{error}");

    // A client with no server to reach gives up within its timeout.
    let start = Instant::now();
    let error = Store::tcp("127.0.0.1", free_port(), 1, 2, Duration::from_millis(500))
        .expect_err("nobody listens");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert!(error.to_string().contains("connect to"), "{error}");
    assert!(matches!(
        Store::tcp("127.0.0.1", port, 2, 2, Duration::from_secs(1)),
        Err(DistError::Invalid(_))
    ));
}

/// NCCL on every visible GPU, one rank per device (NCCL refuses two ranks on one device).
/// Only built with the `nccl` feature, which is for machines with CUDA: without a device it
/// fails rather than passing vacuously.
#[cfg(feature = "nccl")]
#[test]
fn nccl_collectives_on_every_visible_gpu() {
    if let Some(rank) = child_rank() {
        return nccl_rank(rank);
    }
    let _serial = serial();
    let devices = tch::Cuda::device_count() as usize;
    assert!(
        devices > 0,
        "the nccl feature is on but no CUDA device is visible"
    );
    let mut ranks = Ranks::spawn("nccl_collectives_on_every_visible_gpu", devices, &[]);
    ranks.expect_all_success(Duration::from_secs(120));
}

#[cfg(feature = "nccl")]
fn nccl_rank(rank: usize) {
    let world = World::from_env().expect("torchrun's variables");
    let options = GroupOptions::nccl(rank, Duration::from_secs(60));
    let g = ProcessGroup::init(&world, options).expect("NCCL world group");
    let (n, r) = (g.size() as i64, rank as i64);
    let cuda = tch::Device::Cuda(rank);

    let mut t = Tensor::from_slice(&[r + 1, 10 * (r + 1)]).to_device(cuda);
    g.all_reduce(&mut t, ReduceOp::Sum).expect("sum");
    assert_eq!(
        i64s(&t.to_device(tch::Device::Cpu)),
        [n * (n + 1) / 2, 10 * n * (n + 1) / 2]
    );

    let mut t = Tensor::from_slice(&[r as f64]).to_device(cuda);
    g.all_reduce(&mut t, ReduceOp::Avg).expect("avg");
    assert_eq!(f64s(&t.to_device(tch::Device::Cpu)), [(n - 1) as f64 / 2.0]);

    let mut t = Tensor::full([4], r, (Kind::Int64, cuda));
    g.broadcast(&mut t, g.size() - 1).expect("broadcast");
    assert_eq!(i64s(&t.to_device(tch::Device::Cpu)), [n - 1; 4]);

    let input = Tensor::from_slice(&[r, -r]).to_device(cuda);
    let mut output = Tensor::zeros([2 * n], (Kind::Int64, cuda));
    g.all_gather(&mut output, &input).expect("all_gather");
    let expected: Vec<i64> = (0..n).flat_map(|i| [i, -i]).collect();
    assert_eq!(i64s(&output.to_device(tch::Device::Cpu)), expected);

    let input = Tensor::arange(2 * n, (Kind::Int64, cuda));
    let mut output = Tensor::zeros([2], (Kind::Int64, cuda));
    g.reduce_scatter(&mut output, &input, ReduceOp::Sum)
        .expect("reduce_scatter");
    assert_eq!(
        i64s(&output.to_device(tch::Device::Cpu)),
        [2 * r * n, (2 * r + 1) * n]
    );

    if n >= 2 {
        if rank == 0 {
            g.send(&Tensor::from_slice(&[5i64, 6]).to_device(cuda), 1, 0)
                .expect("send");
        } else if rank == 1 {
            let mut t = Tensor::zeros([2], (Kind::Int64, cuda));
            g.recv(&mut t, 0, 0).expect("recv");
            assert_eq!(i64s(&t.to_device(tch::Device::Cpu)), [5, 6]);
        }
    }
    g.shutdown().expect("shutdown");
}

#[test]
fn a_single_process_world_needs_no_launcher() {
    if child_rank().is_some() {
        return;
    }
    let _serial = serial();
    // No launcher variables: rank 0 of 1, on a private store at a port the OS picks.
    let world = World::from_vars(|_| None).expect("single");
    let g = ProcessGroup::init(&world, GroupOptions::gloo(Duration::from_secs(10)))
        .expect("a group of one");
    let mut t = Tensor::from_slice(&[2.5f64, -1.0]);
    g.all_reduce(&mut t, ReduceOp::Avg).expect("avg of one");
    assert_eq!(f64s(&t), [2.5, -1.0]);
    let mut out = Tensor::zeros([2], (Kind::Double, tch::Device::Cpu));
    g.all_gather(&mut out, &t).expect("gather of one");
    assert_eq!(f64s(&out), [2.5, -1.0]);
    g.shutdown().expect("shutdown");
}
