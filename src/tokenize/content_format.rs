//! Which form of message content vLLM gives a chat template: one string, or OpenAI's list of
//! parts.
//!
//! vLLM decides it once per template by reading the template's syntax (`chat_utils`'s
//! `_detect_content_format`): a template that loops over a message's `content` (`{% for part
//! in message['content'] %}`, `message` being an item of `messages` or of a variable set from
//! it) is given lists of parts (`"openai"`); any other is given strings, a message's text parts
//! joined with "\n" (`"string"`). A template vLLM cannot read that way gets `"string"` too.
//! Owns that reading, made as vLLM makes it. Never: renders, or looks at a request.

use std::collections::VecDeque;

use minijinja::machinery::ast::{Expr, Stmt};

/// The form of `content` in the messages a template is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentFormat {
    /// A string: text parts joined with "\n" (vLLM's `"string"`).
    String,
    /// A list of `{"type": "text", "text": ...}` parts, a string content made one part
    /// (vLLM's `"openai"`).
    OpenAi,
}

/// The format vLLM detects for the template `source`.
pub fn detect(source: &str) -> ContentFormat {
    let Ok(root) = minijinja::machinery::parse(source, "chat_template", Default::default()) else {
        return ContentFormat::String;
    };
    let mut statements = Vec::new();
    collect(&root, &mut statements);
    match loops_over_content(&statements) {
        Ok(true) => ContentFormat::OpenAi,
        // vLLM's reading fails (an assertion) where a loop or a `set` it follows has more than
        // one target; it then falls back to "string".
        Ok(false) | Err(MoreThanOneTarget) => ContentFormat::String,
    }
}

struct MoreThanOneTarget;

/// Whether a loop iterates a message's `content`, as vLLM's three passes find it: the names
/// holding `messages` (set from it, a slice or a filter of it), the loop variables over those
/// (messages), then a loop over one of those's `content`.
fn loops_over_content(statements: &[&Stmt<'_>]) -> Result<bool, MoreThanOneTarget> {
    let sets = statements.iter().filter_map(|stmt| match stmt {
        Stmt::Set(set) => Some(&**set),
        _ => None,
    });
    let loops: Vec<_> = statements
        .iter()
        .filter_map(|stmt| match stmt {
            Stmt::ForLoop(for_loop) => Some(&**for_loop),
            _ => None,
        })
        .collect();

    let mut lists = vec!["messages"];
    let mut queue = VecDeque::from(["messages"]);
    while let Some(name) = queue.pop_front() {
        for set in sets.clone() {
            if reads(&set.expr, name, None) {
                let target = single_name(&set.target)?;
                if !lists.contains(&target) {
                    lists.push(target);
                    queue.push_back(target);
                }
            }
        }
    }

    let mut messages = Vec::new();
    for for_loop in &loops {
        if lists.iter().any(|list| reads(&for_loop.iter, list, None)) {
            messages.push(single_name(&for_loop.target)?);
        }
    }

    for for_loop in &loops {
        if messages
            .iter()
            .any(|message| reads(&for_loop.iter, message, Some("content")))
        {
            single_name(&for_loop.target)?;
            return Ok(true);
        }
    }
    Ok(false)
}

fn single_name<'a>(target: &Expr<'a>) -> Result<&'a str, MoreThanOneTarget> {
    match target {
        Expr::Var(var) => Ok(var.id),
        _ => Err(MoreThanOneTarget),
    }
}

/// Whether `expr` is `name` (or `name[key]` / `name.key` with `key`), possibly sliced, filtered
/// or tested.
fn reads(expr: &Expr<'_>, name: &str, key: Option<&str>) -> bool {
    let is_name = |expr: &Expr<'_>| matches!(expr, Expr::Var(var) if var.id == name);
    match expr {
        Expr::Filter(filter) => filter
            .expr
            .as_ref()
            .is_some_and(|inner| reads(inner, name, key)),
        Expr::Test(test) => reads(&test.expr, name, key),
        Expr::Slice(slice) => reads(&slice.expr, name, key),
        _ => match key {
            None => is_name(expr),
            Some(key) => match expr {
                Expr::GetItem(item) => {
                    is_name(&item.expr)
                        && matches!(&item.subscript_expr, Expr::Const(c) if c.value.as_str() == Some(key))
                }
                Expr::GetAttr(attr) => is_name(&attr.expr) && attr.name == key,
                _ => false,
            },
        },
    }
}

/// Every statement under `stmt`, `stmt` first, each before the statements inside it (the
/// order of Jinja's `find_all`).
fn collect<'s, 'a>(stmt: &'s Stmt<'a>, out: &mut Vec<&'s Stmt<'a>>) {
    out.push(stmt);
    let bodies: Vec<&Vec<Stmt<'a>>> = match stmt {
        Stmt::Template(template) => vec![&template.children],
        Stmt::ForLoop(for_loop) => vec![&for_loop.body, &for_loop.else_body],
        Stmt::IfCond(cond) => vec![&cond.true_body, &cond.false_body],
        Stmt::WithBlock(with) => vec![&with.body],
        Stmt::SetBlock(set) => vec![&set.body],
        Stmt::AutoEscape(escape) => vec![&escape.body],
        Stmt::FilterBlock(filter) => vec![&filter.body],
        Stmt::Block(block) => vec![&block.body],
        Stmt::Macro(macro_decl) => vec![&macro_decl.body],
        Stmt::CallBlock(call) => vec![&call.macro_decl.body],
        _ => Vec::new(),
    };
    for body in bodies {
        for child in body {
            collect(child, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_over_a_messages_content_is_openai_and_anything_else_a_string() {
        let cases = [
            // The sim's families: ChatML and DeepSeek read `message['content']` as a string,
            // Llama 3.2 loops over it.
            (include_str!("../../sim/src/tokenizer_dir/chatml.jinja"), ContentFormat::String),
            (
                include_str!("../../sim/src/tokenizer_dir/deepseek-r1-distill.jinja"),
                ContentFormat::String,
            ),
            (include_str!("../../sim/src/tokenizer_dir/llama3.2.jinja"), ContentFormat::OpenAi),
            ("{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}", ContentFormat::OpenAi),
            // Through a variable set from `messages`, a slice, a filter.
            (
                "{% set rest = messages[1:] %}{% set loop_messages = rest | list %}{% for m in loop_messages if m.role %}{% for p in m['content'] | selectattr('type') %}{% endfor %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            // `content` of something that is not a message of `messages`.
            ("{% for p in messages[0]['content'] %}{% endfor %}", ContentFormat::String),
            ("{% for m in others %}{% for p in m.content %}{% endfor %}{% endfor %}", ContentFormat::String),
            // A loop over messages with two targets: vLLM's reading fails, "string".
            ("{% for a, b in messages %}{% endfor %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}", ContentFormat::String),
            // Inside a macro and an if.
            ("{% macro r() %}{% for m in messages %}{% if m %}{% for p in m.content %}{% endfor %}{% endif %}{% endfor %}{% endmacro %}", ContentFormat::OpenAi),
            // A set that loops back on itself ends.
            ("{% set a = messages %}{% set b = a %}{% set a = b %}{% for m in b %}{{ m.content }}{% endfor %}", ContentFormat::String),
            ("{% for m in", ContentFormat::String),
        ];
        for (source, format) in cases {
            assert_eq!(detect(source), format, "{source}");
        }
    }
}
