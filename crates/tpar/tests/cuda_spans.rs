//! The safe operand types of the CUDA backend on a GPU: allreduces of cudarc buffers given as
//! spans (out of place, in place, every algorithm the group supports) on a group of two ranks
//! sharing GPU 0 as threads of this process, and the named errors for operands that do not fit
//! the call (lengths, dtypes, streams) before anything is launched; the fused allreduce +
//! residual add + RMSNorm on spans, fused and unfused, against the CPU reference.
//!
//! Part of the GPU suite: each test is ignored by `cargo test` (the reason says so) and run on
//! the GPU machine by scripts/gpu-check.sh as a prebuilt binary (`cargo test --release -p tpar
//! --test cuda_spans --no-run`, then `cuda_spans --ignored`); asked to run without a GPU, it
//! fails naming why.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use tpar::backend::cuda::driver::DeviceMemory;
use tpar::backend::cuda::fused::{FusedInput, FusedResidual, FusedSpans};
use tpar::backend::cuda::{CudaCommunicator, DeviceSpan, DeviceSpanMut};
use tpar::Config;
use tpar::{Algorithm, DType};

/// Two ranks sharing GPU 0 as threads of this process, a stream each.
fn group() -> (Vec<CudaCommunicator>, Vec<Arc<CudaStream>>) {
    if let Err(why) = tpar::backend::cuda::check_available() {
        panic!("the CUDA span tests need a GPU (run with --ignored only on one): {why}");
    }
    let comms = CudaCommunicator::new_local_group(&[0, 0], Config::default()).unwrap();
    let streams = comms
        .iter()
        .map(|c| c.context().new_stream().unwrap())
        .collect();
    (comms, streams)
}

fn upload(stream: &Arc<CudaStream>, values: &[f32]) -> CudaSlice<f32> {
    stream.clone_htod(values).unwrap()
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn spans_of_cudarc_buffers_reduce_out_of_place_and_in_place() {
    let (comms, streams) = group();
    let count = 140_001; // several chunks
    let inputs: Vec<CudaSlice<f32>> = (0..2)
        .map(|r| {
            let values: Vec<f32> = (0..count).map(|i| (i % 97) as f32 + r as f32).collect();
            upload(&streams[r], &values)
        })
        .collect();
    let expected: Vec<f32> = (0..count).map(|i| 2.0 * (i % 97) as f32 + 1.0).collect();
    for algorithm in Algorithm::ALL {
        if comms[0].supports(algorithm).is_err() {
            eprintln!("{algorithm}: not supported by this group, skipped");
            continue;
        }
        let mut outputs: Vec<CudaSlice<f32>> = streams
            .iter()
            .map(|s| s.alloc_zeros::<f32>(count).unwrap())
            .collect();
        for (r, output) in outputs.iter_mut().enumerate() {
            comms[r]
                .all_reduce(
                    Some(DeviceSpan::of(&inputs[r], &streams[r])),
                    DeviceSpanMut::of(output, &streams[r]),
                    algorithm,
                    &streams[r],
                )
                .unwrap();
        }
        for r in 0..2 {
            comms[r].synchronize(&streams[r]).unwrap();
            let got: Vec<f32> = streams[r].clone_dtoh(&outputs[r]).unwrap();
            assert_eq!(got, expected, "{algorithm}, rank {r}, out of place");
        }
        // In place: the output holds the input.
        let mut buffers: Vec<CudaSlice<f32>> = (0..2)
            .map(|r| streams[r].clone_dtod(&inputs[r]).unwrap())
            .collect();
        for (r, buffer) in buffers.iter_mut().enumerate() {
            comms[r]
                .all_reduce(
                    None,
                    DeviceSpanMut::of(buffer, &streams[r]),
                    algorithm,
                    &streams[r],
                )
                .unwrap();
        }
        for r in 0..2 {
            comms[r].synchronize(&streams[r]).unwrap();
            let got: Vec<f32> = streams[r].clone_dtoh(&buffers[r]).unwrap();
            assert_eq!(got, expected, "{algorithm}, rank {r}, in place");
        }
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn operands_that_do_not_fit_the_call_are_refused_before_launch() {
    let (comms, streams) = group();
    let (comm, stream) = (&comms[0], &streams[0]);
    let input = upload(stream, &[1.0; 64]);
    let mut short = stream.alloc_zeros::<f32>(63).unwrap();
    let err = comm
        .all_reduce(
            Some(DeviceSpan::of(&input, stream)),
            DeviceSpanMut::of(&mut short, stream),
            Algorithm::OneShot,
            stream,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("64 elements and the output 63"), "{err}");

    let mut halves = DeviceMemory::zeroed(comm.context(), 64 * 2).unwrap();
    let err = comm
        .all_reduce(
            Some(DeviceSpan::of(&input, stream)),
            halves.span_mut(DType::F16, 64).unwrap(),
            Algorithm::OneShot,
            stream,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("f32 and the output f16"), "{err}");

    // A span made for one stream, the call on another.
    let mut output = stream.alloc_zeros::<f32>(64).unwrap();
    let err = comm
        .all_reduce(
            Some(DeviceSpan::of(&input, stream)),
            DeviceSpanMut::of(&mut output, &streams[1]),
            Algorithm::OneShot,
            stream,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("another stream"), "{err}");
    // A span longer than its allocation is refused where it is made.
    let err = halves.span_mut(DType::F32, 64).err().unwrap().to_string();
    assert!(
        err.contains("does not fit a device allocation of 128 bytes"),
        "{err}"
    );
    // Nothing was launched: no error word, no poisoned communicator.
    comm.check().unwrap();
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn the_fused_op_takes_spans_and_matches_the_cpu_reference() {
    let (comms, streams) = group();
    let (tokens, hidden, eps) = (3usize, 4096usize, 1e-6f32);
    let count = tokens * hidden;
    let xs: Vec<Vec<f32>> = (0..2)
        .map(|r| {
            (0..count)
                .map(|i| ((i * 7 + r * 3) % 13) as f32 * 0.25 - 1.5)
                .collect()
        })
        .collect();
    let residual: Vec<f32> = (0..count).map(|i| (i % 5) as f32 * 0.5).collect();
    let weight: Vec<f32> = (0..hidden).map(|i| 1.0 + (i % 3) as f32 * 0.125).collect();
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|f| f.to_le_bytes()).collect() };
    let (want_residual, want_y) = tpar::norm::fused_reference(
        DType::F32,
        &[&bytes(&xs[0]), &bytes(&xs[1])],
        &bytes(&residual),
        &bytes(&weight),
        hidden,
        eps,
    );
    // One-shot runs the fused kernel; two-shot the allreduce, then the separate norm kernel.
    for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
        let x: Vec<CudaSlice<f32>> = (0..2).map(|r| upload(&streams[r], &xs[r])).collect();
        let r_in: Vec<CudaSlice<f32>> = (0..2).map(|r| upload(&streams[r], &residual)).collect();
        let w: Vec<CudaSlice<f32>> = (0..2).map(|r| upload(&streams[r], &weight)).collect();
        let mut y: Vec<CudaSlice<f32>> = streams
            .iter()
            .map(|s| s.alloc_zeros::<f32>(count).unwrap())
            .collect();
        let mut r_out: Vec<CudaSlice<f32>> = streams
            .iter()
            .map(|s| s.alloc_zeros::<f32>(count).unwrap())
            .collect();
        for (r, (y, out)) in y.iter_mut().zip(r_out.iter_mut()).enumerate() {
            let s = &streams[r];
            let spans = FusedSpans {
                input: FusedInput::Separate {
                    x: DeviceSpan::of(&x[r], s),
                    y: DeviceSpanMut::of(y, s),
                },
                residual: FusedResidual::Separate {
                    residual: DeviceSpan::of(&r_in[r], s),
                    out: DeviceSpanMut::of(out, s),
                },
                weight: DeviceSpan::of(&w[r], s),
                tokens,
                hidden,
                eps,
            };
            let fused = tpar::dispatch::decide_fused(
                tpar::dispatch::Choice::Tpar(algorithm),
                tpar::DType::F32,
                hidden,
                comms[r].payload_lines(),
                tpar::norm::Prefer::Fused,
            )
            .fused;
            comms[r]
                .fused_add_rms_norm(spans, algorithm, fused, s)
                .unwrap();
        }
        for r in 0..2 {
            comms[r].synchronize(&streams[r]).unwrap();
            let got_y = bytes(&streams[r].clone_dtoh(&y[r]).unwrap());
            let got_residual = bytes(&streams[r].clone_dtoh(&r_out[r]).unwrap());
            assert!(
                got_residual == want_residual,
                "{algorithm}, rank {r}: residual_out"
            );
            assert!(got_y == want_y, "{algorithm}, rank {r}: y");
        }
    }
}
