
#compdef dyn

_dyn_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _DYN_COMPLETE=complete_zsh dyn)
}

compdef _dyn_completion dyn

