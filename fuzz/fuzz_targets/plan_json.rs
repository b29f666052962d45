//! Fuzz plan loading: any bytes given to `braid run PLAN.json` or `braid plan PLAN.json` must be
//! accepted as a verified plan or refused with an error naming the field — never a panic; a
//! plan that loads must write itself back unchanged and load again to the same plan.
//! `scripts/fuzz plan_json 60` (seeds: the plans of `examples/`, written by the script).

#![no_main]

use braid_ir::exec_plan::ExecPlan;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match ExecPlan::from_json(&text) {
        Ok(plan) => {
            let again = ExecPlan::from_json(&plan.to_json()).expect("a loaded plan reloads");
            assert_eq!(again, plan, "the round trip changed a loaded plan");
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
