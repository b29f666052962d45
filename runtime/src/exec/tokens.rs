//! Records as token ids: the prompt a generating model reads, and the sequence a reward model
//! with its own tokenizer scores.
//!
//! **Prompts.** A conversation is always rendered with the generating model's chat template
//! (there is no other faithful way to show a model several turns); a plain prompt is rendered
//! as one user turn when the dataset says `chat_template`, else encoded as it is with the
//! tokenizer's special tokens. A rendered template writes its own special tokens, so its text is
//! encoded without adding them again.
//!
//! **Re-tokenisation.** A model that reads another model's token ids must give every id the
//! same meaning: a reference's `logprobs` and a critic's `values` are per-token numbers aligned
//! with the policy's tokens, so they must share its vocabulary (`Tokenizer::same_vocabulary`),
//! and the executor refuses a run where they do not. A reward model scores a whole sequence,
//! so it need not: when its vocabulary differs it scores the rollout's decoded text,
//! re-tokenised with its own tokenizer — the conversation and the completion as one
//! assistant turn through its chat template when it has one, else the prompt's text followed by
//! the completion. When the vocabularies are the same it scores the policy's ids as they are,
//! which is both faster and exact (re-encoding decoded text need not give back the same ids).
//! This module must not run models.

use super::*;

/// The ids a generating model reads for record `r` of a dataset (`chat_template`: the dataset's
/// option for plain prompts).
pub(super) fn prompt_ids(tok: &Tokenizer, r: &Record, chat_template: bool) -> Result<Vec<i64>> {
    if r.messages.is_some() || chat_template {
        let text = tok.apply_chat_template(&r.conversation(), true)?;
        tok.encode(&text, false)
    } else {
        tok.encode(&r.prompt, true)
    }
}

/// The sequence a reward model with its own tokenizer scores for a completion (`text`, as the
/// policy's tokenizer decoded it) of record `r`: all of it in `prompt`, since a score reads
/// only the last position.
pub(super) fn retokenized(tok: &Tokenizer, r: &Record, text: &str) -> Result<Rollout> {
    let ids = if tok.chat_template().is_some() {
        let mut chat = r.conversation();
        chat.push(ChatMessage {
            role: "assistant".into(),
            content: text.to_string(),
        });
        tok.encode(&tok.apply_chat_template(&chat, false)?, false)?
    } else {
        // Without a template the reward model reads the text the data holds: a plain prompt,
        // or a conversation's turns one per paragraph, then the completion.
        let prompt = match &r.messages {
            None => r.prompt.clone(),
            Some(turns) => turns
                .iter()
                .map(|t| t.content.as_str())
                .collect::<Vec<_>>()
                .join("\n\n"),
        };
        tok.encode(&format!("{prompt}{text}"), true)?
    };
    if ids.is_empty() {
        return Err(Error::invalid(
            tok.source().display().to_string(),
            "a rollout's text encodes to no tokens",
        ));
    }
    Ok(Rollout {
        prompt: ids,
        completion: Vec::new(),
    })
}

/// The sequences inference call `node` on `model` reads for these samples of a rollout: the
/// generating model's ids, or (a reward model with its own tokenizer, `Executor::retokenize`)
/// the samples' text re-tokenised.
pub(super) fn sequences<'a>(
    retokenize: bool,
    tok: &Tokenizer,
    records: &[Record],
    samples: impl Iterator<Item = (usize, &'a str, &'a Rollout)>,
) -> Result<Vec<Rollout>> {
    samples
        .map(|(prompt_index, text, ids)| {
            if !retokenize {
                return Ok(ids.clone());
            }
            let r = records.get(prompt_index).ok_or_else(|| {
                Error::invalid("rollout", format!("prompt {prompt_index} has no record"))
            })?;
            retokenized(tok, r, text)
        })
        .collect()
}
